"""The doctor's quick tier on a real GPU: an honest verdict within its budget, nothing judged that did not run."""

import json

import pytest

pytestmark = pytest.mark.gpu


def test_doctor_quick_on_this_gpu(run_mleng, torch_cuda, tmp_path):
    result = run_mleng("doctor", "--quick", "--json", "--checkpoint-dir", str(tmp_path), timeout=400)
    assert result.returncode in (0, 1), result.stderr
    record = json.loads(result.stdout)
    findings = {f["check"]: f for f in record["rows"]}
    matmul = findings["mamf"]
    # A quick search cut short may be inconclusive, never a warn or fail of its own making.
    if "lower bound" in matmul["summary"]:
        assert matmul["severity"] == "inconclusive"
    assert matmul["severity"] in ("ok", "inconclusive", "fail"), matmul
    if torch_cuda.cuda.device_count() == 1:
        assert findings["comm"]["severity"] == "skipped", findings["comm"]
