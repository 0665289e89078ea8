"""The one precision table (autoplan.precision)."""

import pytest

from autoplan.precision import default_for, from_dtype, from_plan, precision


def test_names_and_bytes():
    assert precision("mixed").plan_dict() == {"params": "float32", "compute": "bfloat16",
                                              "reduce": "float32"}
    assert sum(precision("mixed").state_bytes) == 16 == sum(precision("fp32").state_bytes)
    assert precision("mixed-fp16").loss_scaling and not precision("mixed").loss_scaling
    assert from_dtype("torch.bfloat16").name == "mixed" and from_dtype("float32").name == "fp32"
    assert from_plan({"compute": "float16"}).name == "mixed-fp16"
    assert default_for("cpu-x86").name == "fp32"
    assert default_for("v100-sxm2", bf16=False).name == "mixed-fp16"


@pytest.mark.parametrize("bad", ["bf16", "", None, "MIXED"])
def test_unknown_names_are_refused(bad):
    with pytest.raises(ValueError, match="precision"):
        precision(bad)
