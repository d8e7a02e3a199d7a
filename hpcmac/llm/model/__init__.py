"""The decoder on one rank, with no communication in it.

config (ModelConfig, load_config), weights (safetensors, stage_nbytes), gguf_loader,
backend (numpy, mlx), rope, layers, cache (KVCache), stage (load_stage, Batch, Stage),
spec (each architecture's tensors once; tensor-parallel shards),
sampling, tokenizer, generate (Generator: one-rank generation), fixtures (random
checkpoints for tests).
"""
