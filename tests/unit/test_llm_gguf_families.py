"""The GGUF forms of MiniMax-M2 (llama.cpp's ``minimax-m2``), GLM-4.7-Flash (written by
llama.cpp's converter as ``deepseek2``), Qwen3-Next (``qwen3next``) and Qwen3.5's text
models (``qwen35``, ``qwen35moe``: the linear attention's value heads reordered as llama.cpp's
converter tiles them): each the same model as its safetensors folder and
transformers, and llama.cpp itself (the ``xllamacpp`` wheel) reading the same file to the
same 16 greedy tokens, at F32 and at Q8_0 (an independent check of the names, layouts and
metadata); ``deepseek2`` files told apart by their vocabulary, or refused in one line.

Shapes: the families' odd tiny ones (5 query heads over 1 KV head, a rotary half or
quarter, 6 or 8 experts; 2 key heads for 6 value heads in the linear attention, whose value
heads are as wide as its key heads, as llama.cpp's qwen3next and qwen35 assume); the Q8_0
files 64 wide so that the projections from the hidden state are whole
blocks of 32 (the others stay F32, as the fixture writes what does not divide).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_util import (  # noqa: E402
    PROMPT,
    assert_same_run,
    greedy_without_eos,
    hf_greedy,
    llama_cpp_greedy,
    our_greedy,
)
from test_llm_gguf_glm4_moe import rewrite  # noqa: E402

from hpcmac.errors import UsageError  # noqa: E402
from hpcmac.llm.model.config import load_config  # noqa: E402
from hpcmac.llm.model.fixtures import random_checkpoint, stage_greedy, write_gguf  # noqa: E402
from hpcmac.llm.model.gguf_loader import GGUFCheckpoint  # noqa: E402
from hpcmac.llm.model.stage import load_stage  # noqa: E402
from hpcmac.llm.model.weights import stage_nbytes  # noqa: E402

#: the families of this file, and the config fields their GGUF gives back as the folder has
FAMILIES = ("minimax_m2", "glm4_moe_lite", "qwen3_next", "qwen3_5", "qwen3_5_moe")
FIELDS = ("n_layers", "hidden", "vocab", "n_heads", "n_kv_heads", "head_dim",
          "intermediate", "n_experts", "n_experts_per_tok", "moe_intermediate",
          "n_shared_experts", "n_group", "topk_group", "norm_topk_prob",
          "routed_scaling_factor", "rope_dim", "attention_bias", "o_bias", "tie_embeddings",
          "rope_theta", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
          "shared_intermediate", "layer_types", "linear_k_heads", "linear_v_heads",
          "linear_k_dim", "linear_v_dim", "linear_conv_kernel", "qk_norm")
#: the families' shapes beyond their tiny ones
SHAPES = {a: dict(linear_value_head_dim=8) for a in ("qwen3_next", "qwen3_5", "qwen3_5_moe")}


#: as llama.cpp's converter writes each (deepseek2: kv_b split into attn_k_b, attn_v_b,
#: which the wheel requires)
WRITE = {"glm4_moe_lite": dict(split_kv_b=True)}


def _folder(root, arch, **shapes):
    return random_checkpoint(arch, root / arch, seed=5, initializer_range=0.3,
                             **{**SHAPES.get(arch, {}), **shapes})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ggufam")
    out = {}
    for arch in FAMILIES:
        folder = _folder(root, arch)
        out[arch] = folder, write_gguf(folder, root / f"{arch}.gguf", "F32",
                                           **WRITE.get(arch, {}))
    return out


def _n_layers(path):
    return load_config(path).n_layers


@pytest.mark.parametrize("arch", FAMILIES)
def test_gguf_is_the_folder_and_transformers(files, arch):
    """The F32 GGUF: the folder's configuration, layers and byte count; transformers' 16
    greedy tokens and logits within 1e-4 of the largest at every step."""
    folder, g = files[arch]
    a, b = load_config(folder), load_config(g)
    assert b.arch == a.arch.removesuffix("_text")  # Qwen3.5's text model saved alone
    for field in FIELDS:
        assert getattr(a, field) == pytest.approx(getattr(b, field)), field
    assert [a.is_moe_layer(i) for i in range(a.n_layers)] == \
        [b.is_moe_layer(i) for i in range(b.n_layers)]
    n = a.n_layers
    assert stage_nbytes(g, 0, n, True, True) == stage_nbytes(folder, 0, n, True, True)
    ref = hf_greedy(transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, experts_implementation="eager").eval(), PROMPT)
    assert len(set(ref[0])) > 4
    assert_same_run(our_greedy(load_stage(g, 0, n)), ref, f"{arch} GGUF F32")


#: the families whose Q8_0 file llama.cpp runs to hpcmac's 16 tokens. Qwen3-Next's and
#: Qwen3.5's part (measured, hpcmac fed llama.cpp's tokens: 14 of 16 steps the same choice,
#: the other two 0.8% and 3.3% of the largest logit apart for Qwen3-Next, 0.2% and 0.5% for
#: Qwen3.5): where llama.cpp rounds the linear attention's activations differently is not
#: found; their F32 files give llama.cpp's tokens
Q8_LLAMA_CPP = ("minimax_m2", "glm4_moe_lite")


@pytest.mark.parametrize("arch", FAMILIES)
def test_llama_cpp_gives_the_same_tokens(files, arch, tmp_path):
    """llama.cpp's 16 greedy tokens on the same F32 GGUF are hpcmac's (EOS never chosen:
    llama.cpp's ``ignore_eos``). A Q8_0 file is kept 8-bit (the linear attention's gathered
    rows too), its held bytes the planner's, its tokens and logits those of the same file
    dequantized; and llama.cpp's tokens where :data:`Q8_LLAMA_CPP` says, with hpcmac's
    activations rounded to 8 bits per 32 as llama.cpp multiplies Q8_0 (with float
    activations the two part within 16 tokens on these random models)."""
    pytest.importorskip("xllamacpp")
    g = files[arch][1]
    ours = greedy_without_eos(load_stage(g, 0, _n_layers(g)))
    assert len(set(ours)) > 4
    assert llama_cpp_greedy(g) == ours
    q8 = write_gguf(_folder(tmp_path, arch, hidden_size=64), tmp_path / "q8.gguf", "Q8_0",
                    **WRITE.get(arch, {}))
    n = _n_layers(q8)
    kept = load_stage(q8, 0, n)
    assert kept.formats.get("gguf Q8_0", 0) >= 3 * n, kept.formats
    assert kept.nbytes == stage_nbytes(q8, 0, n, True, True)
    lin = {"qwen3_next": "in_proj_qkvz", "qwen3_5": "in_proj_qkv", "qwen3_5_moe": "in_proj_qkv"}
    if arch in lin:  # gathered from its parts, still 8-bit
        ck, name = GGUFCheckpoint(q8), f"model.layers.0.linear_attn.{lin[arch]}.weight"
        assert ck.stored_nbytes(name) < 2 * ck.numel(name)
    assert_same_run(our_greedy(kept), our_greedy(load_stage(q8, 0, n, keep_quantized=False)),
                    f"{arch} Q8_0 kept")
    if arch in Q8_LLAMA_CPP:
        assert llama_cpp_greedy(q8) == greedy_without_eos(load_stage(q8, 0, n,
                                                                     int8_activations=True))


def test_deepseek2_told_apart_by_vocabulary(files, tmp_path):
    """A ``deepseek2`` file is GLM-4.7-Flash, Kimi K2 or DeepSeek-V3 as its vocabulary
    says (the same layers: the same tokens); one that none claims, DeepSeek-V2's softmax
    routing and the MTP layers that ``block_count`` counts are handled in one line or
    left out."""
    g = files["glm4_moe_lite"][1]
    s = gguf.GGUFValueType.STRING
    u32 = gguf.GGUFValueType.UINT32
    want = stage_greedy(load_stage(g, 0, 3), PROMPT, 4)
    assert load_config(g).arch == "glm4_moe_lite"
    for pre, arch in (("kimi-k2", "kimi_k2"), ("deepseek-v3", "deepseek_v3")):
        f = rewrite(g, tmp_path / f"{arch}.gguf", {"tokenizer.ggml.pre": (pre, s)})
        assert load_config(f).arch == arch
        assert stage_greedy(load_stage(f, 0, 3), PROMPT, 4) == want
    other = rewrite(g, tmp_path / "other.gguf", {"tokenizer.ggml.pre": ("qwen2", s)})
    with pytest.raises(UsageError, match=r"other\.gguf: tokenizer\.ggml\.pre 'qwen2': cannot "
                                         r"tell which of deepseek_v3, .*glm4_moe_lite"):
        load_config(other)
    soft = rewrite(g, tmp_path / "softmax.gguf", {"deepseek2.expert_gating_func": (1, u32)})
    with pytest.raises(UsageError, match=r"softmax\.gguf: metadata deepseek2\.expert_gating"
                                         r"_func = 1: expected 2 \(sigmoid"):
        load_config(soft)

    def with_mtp(r):  # the last layer's tensors again, as the MTP block
        out = {t.name: np.array(t.data) for t in r.tensors}
        out.update({t.name.replace("blk.2.", "blk.3."): np.array(t.data)
                    for t in r.tensors if t.name.startswith("blk.2.")})
        return out

    mtp = rewrite(g, tmp_path / "mtp.gguf", {"deepseek2.block_count": (4, u32),
                                             "deepseek2.nextn_predict_layers": (1, u32)},
                  with_mtp)
    assert load_config(mtp).n_layers == 3
    assert stage_greedy(load_stage(mtp, 0, 3), PROMPT, 4) == want


def test_minimax_softmax_gating_refused(files, tmp_path):
    g = files["minimax_m2"][1]
    soft = rewrite(g, tmp_path / "soft.gguf",
                   {"minimax-m2.expert_gating_func": (1, gguf.GGUFValueType.UINT32)})
    with pytest.raises(UsageError, match=r"soft\.gguf: metadata minimax-m2\.expert_gating_func"
                                         r" = 1: expected 2"):
        load_config(soft)


def test_qwen3_next_older_layout_refused(files, tmp_path):
    """A Qwen3-Next file with the older fused ``ssm_in`` is one line naming the tensor, before
    any weights load."""
    g = files["qwen3_next"][1]

    def fused(r):
        return {t.name.replace("attn_qkv", "ssm_in"): np.array(t.data) for t in r.tensors}

    old = rewrite(g, tmp_path / "old.gguf", tensors=fused)
    with pytest.raises(UsageError, match=r"old\.gguf: tensor blk\.0\.ssm_in\.weight: the older "
                                         r"fused in_proj_qkvz is not read"):
        load_config(old)
