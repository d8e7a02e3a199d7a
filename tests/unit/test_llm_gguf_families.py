"""The GGUF forms of MiniMax-M2 (llama.cpp's ``minimax-m2``) and GLM-4.7-Flash (written by
llama.cpp's converter as ``deepseek2``): each the same model as its safetensors folder and
transformers, and llama.cpp itself (the ``xllamacpp`` wheel) reading the same file to the
same 16 greedy tokens, at F32 and at Q8_0 (an independent check of the names, layouts and
metadata); ``deepseek2`` files told apart by their vocabulary, or refused in one line.

Shapes: the families' odd tiny ones (5 query heads over 1 KV head, a rotary half, 6 or 8
experts); the Q8_0 files 64 wide so that the projections from the hidden state are whole
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
from hpcmac.llm.model.stage import load_stage  # noqa: E402
from hpcmac.llm.model.weights import stage_nbytes  # noqa: E402

#: the families of this file, and the config fields their GGUF gives back as the folder has
FAMILIES = ("minimax_m2", "glm4_moe_lite")
FIELDS = ("arch", "n_layers", "hidden", "vocab", "n_heads", "n_kv_heads", "head_dim",
          "intermediate", "n_experts", "n_experts_per_tok", "moe_intermediate",
          "n_shared_experts", "n_group", "topk_group", "norm_topk_prob",
          "routed_scaling_factor", "rope_dim", "attention_bias", "o_bias", "tie_embeddings",
          "rope_theta", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")


#: as llama.cpp's converter writes each (deepseek2: kv_b split into attn_k_b, attn_v_b,
#: which the wheel requires)
WRITE = {"glm4_moe_lite": dict(split_kv_b=True)}


def _folder(root, arch, **shapes):
    return random_checkpoint(arch, root / arch, seed=5, initializer_range=0.3, **shapes)


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


@pytest.mark.parametrize("arch", FAMILIES)
def test_llama_cpp_gives_the_same_tokens(files, arch, tmp_path):
    """llama.cpp's 16 greedy tokens on the same F32 GGUF are hpcmac's, and on a Q8_0 one
    kept 8-bit, with hpcmac's activations rounded to 8 bits per 32 as llama.cpp multiplies
    Q8_0 (with float activations the two part within 16 tokens on these random models).
    EOS is never chosen: llama.cpp's ``ignore_eos``."""
    pytest.importorskip("xllamacpp")
    g = files[arch][1]
    ours = greedy_without_eos(load_stage(g, 0, _n_layers(g)))
    assert len(set(ours)) > 4
    assert llama_cpp_greedy(g) == ours
    q8 = write_gguf(_folder(tmp_path, arch, hidden_size=64), tmp_path / "q8.gguf", "Q8_0",
                    **WRITE.get(arch, {}))
    st = load_stage(q8, 0, _n_layers(q8), int8_activations=True)
    assert any("Q8_0" in s for s in st.formats), st.formats
    assert llama_cpp_greedy(q8) == greedy_without_eos(st)


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
