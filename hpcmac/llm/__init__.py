"""hpcmac.llm: decoder-only LLM inference (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3).

config (ModelConfig, load_config), weights (safetensors, stage_nbytes), gguf_loader,
backend (numpy, mlx), rope, layers, cache (KVCache), model (load_stage, Batch, Stage),
sampling, tokenizer, generate (Generator), fixtures (random checkpoints for tests);
stages and pipeline spread a model over ranks. ``python -m hpcmac.llm generate``.
"""
