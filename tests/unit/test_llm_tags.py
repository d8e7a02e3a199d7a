"""Message tags: taken in one module, all different (two modules that each picked 73
once made a busy report's receive take a logprob row and stop the server)."""

from __future__ import annotations

import re
from pathlib import Path

from hpcmac.llm.parallel import tags

ROOT = Path(__file__).resolve().parents[2]


def test_tags_differ():
    assert len(set(tags.ALL.values())) == len(tags.ALL), tags.ALL
    assert {"TAG_FWD", "TAG_RET", "TAG_LOGP", "TAG_BUSY", "TAG_SUM", "TAG_STEP",
            "TAG_HEAD", "TAG_WAKE"} <= set(tags.ALL)


def test_no_module_takes_its_own_tag():
    own = re.compile(r"^(TAG_\w+(\s*,\s*TAG_\w+)*)\s*=\s*\d", re.M)
    found = [f"{p.relative_to(ROOT)}: {m.group(1)}"
             for d in ("hpcmac/llm", "hpcmac/plan") for p in (ROOT / d).rglob("*.py")
             if p.name != "tags.py" for m in own.finditer(p.read_text())]
    assert not found, f"take these tags in hpcmac/llm/parallel/tags.py: {found}"
