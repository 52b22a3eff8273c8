"""The checked GEMM's tuning store (`kernels/abft_gemm/tune_store.py`): timed picks kept across processes.

A "new process" is a new `TuneStore` over the same directory: it starts from the file alone. The tuner's
integration is checked with stand-in timings (no GPU): a pick timed once is served from the file by a
later store without timing anything, and never where the key, the device or the kernel version differs.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings

import pytest
import torch

pytest.importorskip("triton")

from ft_transformers.kernels.abft_gemm import calls, forms, tuning  # noqa: E402
from ft_transformers.kernels.abft_gemm.tune_store import FORMAT, TuneStore, encode_key, fingerprint  # noqa: E402
from ft_transformers.kernels.options import Options, override  # noqa: E402

KEY = (torch.float16, False, True, False, True, False, 4096, 896, 4864, False, (), None)
CFG = (128, 128, 64, 8, 3)


def test_a_new_store_reads_what_an_earlier_one_wrote(tmp_path):
    first = TuneStore(tmp_path, "GPU-A (sm_90)")
    assert first.get(KEY) is None and len(first) == 0
    first.put(KEY, CFG)
    split_off = KEY[:6] + (16,) + KEY[7:]
    first.put(split_off, (16, 64, 64, 4, 1, False))  # the unsplit form of a split config keeps its False
    later = TuneStore(tmp_path, "GPU-A (sm_90)")
    assert later.get(KEY) == CFG
    assert later.get(split_off) == (16, 64, 64, 4, 1, False)
    assert later.get(KEY[:-1] + (2,)) is None  # another split setting is another key
    data = json.loads(later.path.read_text())
    assert data["format"] == FORMAT and data["device"] == "GPU-A (sm_90)" and len(data["entries"]) == 2
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary file was replaced into place


def test_another_device_or_kernel_version_gets_its_own_file(tmp_path, monkeypatch):
    TuneStore(tmp_path, "GPU-A (sm_90)").put(KEY, CFG)
    assert TuneStore(tmp_path, "GPU-B (sm_80)").get(KEY) is None
    before = fingerprint("GPU-A (sm_90)")
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert fingerprint("GPU-A (sm_90)") != before
    assert TuneStore(tmp_path, "GPU-A (sm_90)").get(KEY) is None


def test_key_encoding_is_stable_and_refuses_unknown_types():
    assert encode_key(KEY) == encode_key(tuple(KEY))
    assert json.loads(encode_key(KEY))[0] == "torch.float16"
    assert encode_key((torch.float16,)) != encode_key((torch.bfloat16,))
    assert encode_key((1, (2, 3), None)) != encode_key((1, (2, 3), 0))
    with pytest.raises(TypeError, match="stable encoding"):
        encode_key((object(),))


def test_concurrent_writers_merge(tmp_path):
    a, b = TuneStore(tmp_path, "GPU-A (sm_90)"), TuneStore(tmp_path, "GPU-A (sm_90)")
    other = KEY[:6] + (512,) + KEY[7:]
    a.put(KEY, CFG)
    b.put(other, (64, 128, 64, 4, 4))  # b never saw a's entry in memory: the write merges the file's
    fresh = TuneStore(tmp_path, "GPU-A (sm_90)")
    assert fresh.get(KEY) == CFG and fresh.get(other) == (64, 128, 64, 4, 4)


def test_unreadable_file_warns_and_is_rewritten(tmp_path):
    path = TuneStore(tmp_path, "GPU-A (sm_90)").path
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable GEMM tuning store"):
        st = TuneStore(tmp_path, "GPU-A (sm_90)")
    assert len(st) == 0
    st.put(KEY, CFG)
    assert TuneStore(tmp_path, "GPU-A (sm_90)").get(KEY) == CFG


def test_bad_entries_are_dropped(tmp_path):
    st = TuneStore(tmp_path, "GPU-A (sm_90)")
    good = encode_key(KEY)
    entries = {good: list(CFG), "a": [0, 64, 64, 4, 3], "b": [64, 64, 64], "c": [64, 64, 64, 4, 3, True],
               "d": "64,64", "e": [64.0, 64, 64, 4, 3]}
    st.path.write_text(json.dumps({"format": FORMAT, "entries": entries}))
    assert len(TuneStore(tmp_path, "GPU-A (sm_90)")) == 1
    st.path.write_text(json.dumps({"format": FORMAT + 1, "entries": {good: list(CFG)}}))
    with pytest.warns(UserWarning, match="unreadable"):
        assert TuneStore(tmp_path, "GPU-A (sm_90)").get(KEY) is None


def test_unwritable_directory_warns_once_and_keeps_the_pick(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the store's directory would be
    st = TuneStore(blocker / "sub", "GPU-A (sm_90)")
    with pytest.warns(UserWarning, match="cannot write the GEMM tuning store"):
        st.put(KEY, CFG)
    assert st.get(KEY) == CFG and not st.writable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st.put(KEY[:-1] + (2,), CFG)  # no second warning


def test_options_read_the_store_directory():
    home = os.path.join(os.path.expanduser("~"), ".cache", "ft_transformers")
    assert Options.from_env({}).tune_cache_dir == home
    assert Options.from_env({"XDG_CACHE_HOME": "/x"}).tune_cache_dir == os.path.join("/x", "ft_transformers")
    assert Options.from_env({"FTT_CACHE_DIR": "/y"}).tune_cache_dir == "/y"
    assert Options.from_env({"FTT_TUNE_CACHE": "0", "FTT_CACHE_DIR": "/y"}).tune_cache_dir is None


@pytest.fixture
def tuner(monkeypatch, tmp_path):
    """`tuning.pick_config` outside the interpreter with stand-in launches and timings, its store in
    ``tmp_path``: returns ``(pick, timed)`` where ``pick()`` tunes a 200 × 80 × 96 fp16 tile call and
    ``timed`` lists the configs it timed."""
    monkeypatch.setattr(forms, "INTERP", False)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tuning, "CONFIGS_LARGE", [(64, 64, 32, 4, 2), (64, 128, 32, 4, 2)])
    monkeypatch.setattr(tuning, "CONFIGS_NARROW", [])
    monkeypatch.setattr(tuning, "_TUNE_CACHE", {})
    monkeypatch.setattr(tuning, "_STORES", {})
    monkeypatch.setattr(tuning, "device_tag", lambda index: "GPU-A (sm_90)")
    monkeypatch.setattr(tuning, "_store", lambda dev, real=tuning._store: real(torch.device("cuda", 0)))
    timed = []
    monkeypatch.setattr(tuning, "_launch_gemm", lambda cfg, L, **kw: timed.append(cfg))
    times = {64: 2.0, 128: 1.0}  # BLOCK_N: "ms"
    monkeypatch.setattr(tuning, "gpu_time", lambda run: (run(), times[timed[-1][1]])[1])
    x, w = torch.randn(200, 96).half(), torch.randn(80, 96).half()
    launch = calls._Launch(x=x, w=w, b=None, y=torch.empty(200, 80).half(), swn=w.stride(0), swk=w.stride(1))

    def pick():
        return tuning.pick_config(launch, bias=None, detect=True, verify_output=False, dot_f32=False)

    with override(gemm_config=None, gemm_tune=True, gemm_split=1, tune_cache_dir=str(tmp_path)):
        yield pick, timed


def test_tuner_serves_a_stored_pick_without_timing(tuner, tmp_path, monkeypatch):
    pick, timed = tuner
    assert pick() == (64, 128, 32, 4, 2) and len(timed) == 2  # both candidates timed, the faster kept
    assert len(list(tmp_path.glob("gemm_tune-*.json"))) == 1
    # a new process: empty in-memory cache and stores, the file alone
    monkeypatch.setattr(tuning, "_TUNE_CACHE", {})
    monkeypatch.setattr(tuning, "_STORES", {})
    timed.clear()
    assert pick() == (64, 128, 32, 4, 2) and timed == []
    # the stored pick is the tuner's, not a default: a store saying otherwise is followed
    st = next(iter(tuning._STORES.values()))
    key = next(iter(tuning._TUNE_CACHE))
    st.put(key, (64, 64, 32, 4, 2))
    monkeypatch.setattr(tuning, "_TUNE_CACHE", {})
    monkeypatch.setattr(tuning, "_STORES", {})
    assert pick() == (64, 64, 32, 4, 2) and timed == []


def test_tuner_without_store_or_tuning_ignores_the_file(tuner, tmp_path, monkeypatch):
    pick, timed = tuner
    pick()
    monkeypatch.setattr(tuning, "_TUNE_CACHE", {})
    monkeypatch.setattr(tuning, "_STORES", {})
    timed.clear()
    with override(tune_cache_dir=None):  # FTT_TUNE_CACHE=0: timed again, nothing read
        assert pick() == (64, 128, 32, 4, 2) and len(timed) == 2
    monkeypatch.setattr(tuning, "_TUNE_CACHE", {})
    timed.clear()
    with override(gemm_tune=False):  # FTT_ABFT_GEMM_TUNE=0 keeps its rule (the first candidate), store or not
        assert pick() == (64, 64, 32, 4, 2) and timed == []


def test_efta_autotune_keeps_its_timings_unless_switched_off():
    """EFTA's autotuner keeps each shape key's timings in Triton's cache, and ``FTT_TUNE_CACHE=0`` (read
    once, at import) turns that off as it turns off the GEMM's store. (Triton itself keeps nothing under its
    interpreter, so the import runs without it.)"""
    import subprocess
    import sys

    code = ("from ft_transformers.kernels.efta.configs import _efta_fwd_tuned as t; "
            "from ft_transformers.kernels.options import options; "
            "print(t.cache_results, options().tune_cache_dir is None)")
    for value, want in (("1", "True False"), ("0", "False True")):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["FTT_TUNE_CACHE"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split("\n")[-2] == want, out.stdout
