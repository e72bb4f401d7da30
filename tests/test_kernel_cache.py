"""Results must not depend on whether a kernel was compiled in this process or loaded from numba's on-disk cache.

With fastmath, LLVM reassociated float sums differently in the two cases (1 ulp, amplified by the int8
activations), so the same prompt gave different logits in a first and a later run. The kernels now sum in a
fixed order (dot_float.fdot) and none has fastmath; the first test checks the outcome end to end, the second the
cause.
"""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba.core.registry import CPUDispatcher

import strata_nb.cpu_kernels as cpu_kernels
from strata_nb.synth import write_synthetic

# One process: a prompt of 5 tokens (the int8 drivers' four-token and one-token kernels), all its logits, then one
# decode step. Prints which kernels came from the cache.
_RUN = r"""
import json, sys
import numpy as np
import pytest
import strata_nb
from strata_nb.api import load
from strata_nb.cpu_kernels import ops

path, out = sys.argv[1], sys.argv[2]
eng = load(path, device="cpu", n_ctx=32, threads=2)
s = eng.new_session()
prompt = eng.backend.forward(s, np.array([5, 9, 2, 7, 3], np.int64), all_logits=True)
step = eng.backend.forward(s, np.array([int(prompt[-1].argmax())], np.int64))
np.save(out, np.concatenate([prompt, step]))
st = ops.attention_block.stats
print(json.dumps({"hits": sum(st.cache_hits.values()), "misses": sum(st.cache_misses.values())}))
"""


def _run(model: Path, cache: Path, out: Path) -> dict:
    env = dict(os.environ, STRATA_NB_CACHE=str(cache))
    env.pop("NUMBA_CACHE_DIR", None)  # _numba_env derives it from STRATA_NB_CACHE
    r = subprocess.run([sys.executable, "-c", _RUN, str(model), str(out)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_compiled_and_cached_engine_agree(tmp_path):
    """Process 1 compiles every kernel into an empty cache; process 2 loads them from it: bit-identical logits."""
    model = tmp_path / "tiny.gguf"
    write_synthetic(model, "micro", quant="Q8_0", seed=11)
    cache = tmp_path / "cache"
    first = _run(model, cache, tmp_path / "first.npy")
    second = _run(model, cache, tmp_path / "second.npy")
    assert first == {"hits": 0, "misses": 1}  # compiled...
    assert second == {"hits": 1, "misses": 0}  # ...then loaded
    a, b = np.load(tmp_path / "first.npy"), np.load(tmp_path / "second.npy")
    assert a.shape[0] == 6 and np.isfinite(a).all()
    assert np.array_equal(a, b), f"max |diff| {np.abs(a - b).max()}"


def _dispatchers():
    for m in pkgutil.iter_modules(cpu_kernels.__path__):
        mod = importlib.import_module(f"strata_nb.cpu_kernels.{m.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, CPUDispatcher) and obj.py_func.__module__ == mod.__name__:
                yield f"{m.name}.{name}", obj
    # the matrix drivers are made per quant type: one of each maker (a dispatcher, not compiled)
    from strata_nb.cpu_kernels import matmul
    from strata_nb.cpu_kernels.qtypes import Q4_K, Q8_0

    for name, make, key in (("matmul_for", matmul._make_matmul, (True, Q8_0)),
                            ("moe_matmul_for", matmul._make_moe_matmul, (True, Q8_0)),
                            ("moe_ffn_for", matmul._make_moe_ffn, (True, Q4_K, Q4_K, Q8_0)),
                            ("dequant_rows_for", matmul._make_dequant_rows, (Q8_0,))):
        yield f"matmul.{name}", make(*key)


def test_no_kernel_uses_fastmath():
    found = dict(_dispatchers())
    assert {"ops.rmsnorm", "ops.attention_block", "ops._attend_heads", "dot_float.fdot", "actq.quantize_row",
            "matmul.moe_ffn_for"} <= set(found)
    bad = [name for name, d in found.items() if d.targetoptions.get("fastmath")]
    assert not bad, f"kernels with fastmath (their float sums are reordered per compile): {bad}"


_HELPERS = r"""
import json, sys
import numpy as np
import pytest
import strata_nb
from strata_nb.api import load

eng = load(sys.argv[1], device="cpu", n_ctx=32, threads=2)
eng.warm_up()
kerns = {id(k): k for k, *_ in eng.backend._moe.values()}
hits = sum(sum(k.stats.cache_hits.values()) for k in kerns.values())
misses = sum(sum(k.stats.cache_misses.values()) for k in kerns.values())
s = eng.new_session()
np.save(sys.argv[2], eng.backend.forward(s, np.array([5, 9, 2, 7, 3], np.int64), all_logits=True))
print(json.dumps({"drivers": len(kerns), "hits": hits, "misses": misses}))
"""


def test_first_run_compiles_the_routed_experts_in_helpers(tmp_path):
    """On an empty numba cache with two or more cores, helper processes compile the routed-expert drivers while the
    engine compiles the rest; the engine loads them from the cache (compiles none of them itself), and its logits
    are those of a later run that loads everything."""
    from strata_nb.runtime import warm

    if warm.helpers_wanted(1) < 1:
        pytest.skip("one core: no compile helpers")
    path = tmp_path / "m.gguf"
    write_synthetic(path, "tiny", arch="qwen3moe", quant="Q8_0", seed=3)
    env = {**os.environ, "STRATA_NB_CACHE": str(tmp_path / "cache")}
    runs = []
    for i in range(2):
        out = tmp_path / f"logits{i}.npy"
        r = subprocess.run([sys.executable, "-c", _HELPERS, str(path), str(out)], capture_output=True, text=True,
                           timeout=900, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append((json.loads(r.stdout.strip().splitlines()[-1]), np.load(out)))
    (first, a), (second, b) = runs
    assert first["drivers"] >= 1 and first["misses"] == 0 and first["hits"] >= first["drivers"], first
    assert second["misses"] == 0, second
    assert np.array_equal(a, b)


def test_compile_helpers_that_fail_or_run_late_are_reported(tmp_path):
    """join() names a helper that exited with an error (its last stderr line) and stops one still running at the
    deadline: the warm-up then compiles those kernels itself."""
    from strata_nb.runtime import warm

    if warm.helpers_wanted(1) < 1:
        pytest.skip("one core: no compile helpers")
    bad = warm.start(tmp_path / "missing.gguf", True, [0])
    msgs = warm.join(bad, 120.0)
    assert len(msgs) == 1 and "exited with 1" in msgs[0] and "error:" in msgs[0], msgs
    path = tmp_path / "m.gguf"
    write_synthetic(path, "tiny", arch="qwen3moe", quant="Q8_0", seed=3)
    slow = warm.start(path, True, [0])
    msgs = warm.join(slow, 0.0)
    assert len(msgs) == 1 and "still running" in msgs[0], msgs
    assert slow[0].returncode is not None  # stopped, not left behind
