"""GLM-4.x as GGUF (llama.cpp's ``glm4moe``): the same model as the safetensors folder and
transformers, and llama.cpp itself (the ``xllamacpp`` wheel) reading the same file to the
same greedy tokens (an independent check of the names and metadata); the MTP layers
``block_count`` counts are left out.

Shapes: the family's odd tiny ones (5 query heads over 1 KV head of 12, a rotary half of
6, 6 experts in 2 groups, 2 a token, one shared expert, the first layer dense).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from gguf_util import (  # noqa: E402
    PROMPT,
    N,
    assert_same_run,
    hf_greedy,
    llama_cpp_greedy,
    our_greedy,
)

from hpcmac.errors import UsageError  # noqa: E402
from hpcmac.llm.model.config import load_config  # noqa: E402
from hpcmac.llm.model.fixtures import random_checkpoint, stage_greedy, write_gguf  # noqa: E402
from hpcmac.llm.model.stage import load_stage  # noqa: E402
from hpcmac.llm.model.weights import stage_nbytes  # noqa: E402

FIELDS = ("arch", "n_layers", "hidden", "vocab", "n_heads", "n_kv_heads", "head_dim",
          "intermediate", "n_experts", "n_experts_per_tok", "moe_intermediate",
          "n_shared_experts", "first_k_dense", "n_group", "topk_group", "norm_topk_prob",
          "routed_scaling_factor", "partial_rotary_factor", "rope_dim", "attention_bias",
          "o_bias", "qk_norm", "tie_embeddings", "rope_theta")


def rewrite(src, out, keys=None, tensors=None):
    """A copy of the GGUF ``src`` with metadata ``keys`` (key -> (value, GGUFValueType))
    set or added and its tensors as ``tensors(reader)`` gives them (name -> array)."""
    keys = dict(keys or {})
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(out), str(r.fields["general.architecture"].contents()))
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in keys:
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for key, (value, vtype) in keys.items():
        w.add_key_value(key, value, vtype)
    arrays = tensors(r) if tensors else {t.name: np.array(t.data) for t in r.tensors}
    for name, a in arrays.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm")
    folder = random_checkpoint("glm4_moe", root / "hf", seed=3, initializer_range=0.3)
    return folder, write_gguf(folder, root / "f32.gguf", "F32")


def test_gguf_is_the_folder_and_transformers(files):
    """The F32 GGUF: the folder's configuration and byte count, transformers' 16 greedy
    tokens and logits within 1e-4 of the largest at every step."""
    folder, g = files
    a, b = load_config(folder), load_config(g)
    for field in FIELDS:
        assert getattr(a, field) == pytest.approx(getattr(b, field)), field
    assert stage_nbytes(g, 0, 3, True, True) == stage_nbytes(folder, 0, 3, True, True)
    ref = hf_greedy(transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, experts_implementation="eager").eval(), PROMPT)
    assert len(set(ref[0])) > 4
    assert_same_run(our_greedy(load_stage(g, 0, 3)), ref, "GGUF F32")


def test_llama_cpp_gives_the_same_tokens(files):
    """llama.cpp's 16 greedy tokens on the same GGUF are hpcmac's."""
    pytest.importorskip("xllamacpp")
    g = files[1]
    ours = stage_greedy(load_stage(g, 0, 3), PROMPT, N)
    assert llama_cpp_greedy(g) == ours


def test_mtp_layers_left_out(files, tmp_path):
    """``block_count`` with ``nextn_predict_layers`` counts the MTP layer at the end (its
    tensors there, as llama.cpp's converter writes them): the model is the layers before
    it, with the same tokens; a gating other than sigmoid is one line."""
    g = files[1]
    u32 = gguf.GGUFValueType.UINT32

    def with_mtp(r):  # a copy of the last layer's tensors as the MTP block
        out = {t.name: np.array(t.data) for t in r.tensors}
        out.update({t.name.replace("blk.2.", "blk.3."): np.array(t.data)
                    for t in r.tensors if t.name.startswith("blk.2.")})
        return out

    mtp = rewrite(g, tmp_path / "mtp.gguf", {"glm4moe.block_count": (4, u32),
                                             "glm4moe.nextn_predict_layers": (1, u32)},
                  with_mtp)
    assert load_config(mtp).n_layers == 3
    assert stage_greedy(load_stage(mtp, 0, 3), PROMPT, 4) == \
        stage_greedy(load_stage(g, 0, 3), PROMPT, 4)
    soft = rewrite(g, tmp_path / "softmax.gguf", {"glm4moe.expert_gating_func": (1, u32)})
    with pytest.raises(UsageError, match=r"softmax\.gguf: metadata "
                                         r"glm4moe\.expert_gating_func = 1: expected 2"):
        load_config(soft)
