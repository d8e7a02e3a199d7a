"""LUOptions: netlib's variant names accepted, anything else a ValueError naming the field."""

import pytest

from hpcmac.linalg.lu import LUOptions


def test_defaults_and_all_variants_accepted():
    LUOptions()
    for f in ("left", "crout", "right"):
        LUOptions(pfact=f, rfact=f)
    for b in ("1ring", "1ringM", "2ring", "2ringM", "long", "longM"):
        LUOptions(bcast=b)
    for s in ("binexch", "spread", "mix"):
        LUOptions(swap=s)


@pytest.mark.parametrize("field,value", [
    ("pfact", "middle"), ("rfact", 1), ("bcast", "3ring"), ("depth", 2), ("depth", True),
    ("swap", "long"), ("nbmin", 0), ("ndiv", 1), ("swap_threshold", -1), ("align", 0),
    ("l1_transposed", "yes"), ("u_transposed", 0), ("equil", None),
])
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"LUOptions.{field}"):
        LUOptions(**{field: value})
