"""The decoder on one rank, with no communication in it.

config (ModelConfig, load_config), weights (safetensors, stage_nbytes), gguf_loader,
backend (numpy, mlx), rope, layers, cache (KVCache), stage (load_stage, Batch, Stage),
arch (one module per model family, registered by model_type; arch.blocks: the shared
blocks each family's layers are made of), spec (a layer's tensors as its family's blocks
describe them; tensor-parallel shards),
sampling, tokenizer, generate (Generator: one-rank generation), fixtures (random
checkpoints for tests).
"""
