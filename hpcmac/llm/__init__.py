"""hpcmac.llm: decoder-only LLM inference (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3).

model/ is the decoder on one rank, communication-free; parallel/ spreads it over
ranks (plan, pipeline); cli is ``python -m hpcmac.llm generate`` for 1 and N ranks.
"""
