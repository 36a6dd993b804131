"""CPU testbed: locations, the sgl_kernel stand-in, the tiny model, setup.sh error paths, interpreter choice."""

from __future__ import annotations

import ast
import json
import os
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from repro import interpreter, testbed
from repro.interpreter import InterpreterError, choose_python
from repro.targets.sglang import SGLangAdapter

SGLANG = SGLangAdapter()

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / "scripts" / "cpu_testbed" / "setup.sh"


# ---- locations -------------------------------------------------------------------------------------------------
def test_testbed_dir_default_env_and_xdg(monkeypatch, tmp_path: Path):
    monkeypatch.delenv("REPRO_TESTBED_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert testbed.testbed_dir() == Path.home() / ".cache" / "tp-deadlock-repro" / "testbed" / f"sglang-{testbed.SGLANG_VERSION}"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert testbed.testbed_dir() == tmp_path / "xdg" / "tp-deadlock-repro" / "testbed" / f"sglang-{testbed.SGLANG_VERSION}"
    monkeypatch.setenv("REPRO_TESTBED_DIR", str(tmp_path / "tb"))
    assert testbed.testbed_dir() == tmp_path / "tb"


def _fake_python(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def test_is_set_up_needs_python_and_stamp(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("REPRO_TESTBED_DIR", str(tmp_path))
    assert testbed.testbed_python() is None and not testbed.is_set_up()
    _fake_python(tmp_path / "venv" / "bin" / "python", "exit 0")
    assert testbed.testbed_python() == tmp_path / "venv" / "bin" / "python"
    assert not testbed.is_set_up()
    (tmp_path / testbed.STAMP_NAME).write_text("sglang=x\n")
    assert testbed.is_set_up()


def test_setup_sh_and_testbed_py_pin_the_same_versions():
    text = SETUP.read_text()
    assert f'SGLANG_VERSION="{testbed.SGLANG_VERSION}"' in text
    assert f'TORCH_VERSION="{testbed.TORCH_VERSION}"' in text


# ---- tiny model ----------------------------------------------------------------------------------------------------
def test_tiny_model_is_config_only_llama():
    d = testbed.tiny_model_dir()
    assert sorted(p.name for p in d.iterdir()) == ["config.json"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["torch_dtype"]) == (64, 2, 4, 2, 1024, "float32")
    # TP=2 must split heads and KV heads evenly.
    assert cfg["num_attention_heads"] % 2 == 0 and cfg["num_key_value_heads"] % 2 == 0


# ---- sgl_kernel stand-in (real torch, in the testbed interpreter) -----------------------------------------------------
STAND_IN_CHECK = textwrap.dedent(
    """
    import ctypes, sys, torch
    import sgl_kernel
    assert sgl_kernel.__file__.startswith(sys.argv[1]), sgl_kernel.__file__
    from sgl_kernel import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu

    # assign_req_to_token_pool_cpu: entries laid out back to back in out_cache_loc.
    req_to_token = torch.zeros((4, 10), dtype=torch.int32)
    assign_req_to_token_pool_cpu(torch.tensor([2, 0]), req_to_token, torch.tensor([1, 0]), torch.tensor([4, 2]),
                                 torch.tensor([7, 8, 9, 5, 6], dtype=torch.int64), 10)
    assert req_to_token[2, 1:4].tolist() == [7, 8, 9], req_to_token
    assert req_to_token[0, 0:2].tolist() == [5, 6], req_to_token
    assert int(req_to_token.sum()) == 7 + 8 + 9 + 5 + 6

    # copy_all_layer_kv_cache_cpu: slot src -> tgt in every layer buffer.
    bufs = [torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3) + 100 * i for i in range(2)]
    ref = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
    copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([5, 6]), torch.tensor([1, 2]))
    for b, r in zip(bufs, ref):
        r[5], r[6] = r[1].clone(), r[2].clone()
        assert torch.equal(b, r), (b, r)

    # Unprovided names raise a clear error only when called.
    for name in ("verify_tree_greedy_cpu", "fill_bonus_tokens_cpu"):
        try:
            getattr(sgl_kernel, name)()
        except NotImplementedError as e:
            assert "not provided by the CPU stand-in" in str(e), e
        else:
            raise AssertionError(name + " did not raise")
    from sgl_kernel.mamba import causal_conv1d_update_cpu
    try:
        causal_conv1d_update_cpu()
    except NotImplementedError:
        pass
    else:
        raise AssertionError("mamba stand-in did not raise")

    # No torch.ops.sgl_kernel ops: sglang's AMX detection stays off.
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
    print("stand-in ok")
    """
)


def test_sgl_kernel_stand_in_implements_generate_path_ops_and_registers_no_torch_ops(torch_python: str, tmp_path: Path):
    script = tmp_path / "check.py"
    script.write_text(STAND_IN_CHECK)
    env = {**os.environ, "PYTHONPATH": str(testbed.stub_dir())}
    r = subprocess.run([torch_python, str(script), str(testbed.stub_dir())], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stand-in ok" in r.stdout


def _module_level_sgl_kernel_imports(sglang_dir: Path) -> dict[str, set[str]]:
    """module ('sgl_kernel' / 'sgl_kernel.mamba') -> names imported at module level (not inside a function)."""
    found: dict[str, set[str]] = {}

    def visit(node, in_func: bool) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, ast.ImportFrom) and not in_func and (ch.module or "").startswith("sgl_kernel"):
                found.setdefault(ch.module, set()).update(a.name for a in ch.names)
            visit(ch, in_func or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    for f in sglang_dir.rglob("*.py"):
        if "multimodal_gen" in f.parts or "test" in f.parts:
            continue
        try:
            text = f.read_text(encoding="utf-8")
            if "sgl_kernel" not in text:
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                visit(ast.parse(text), False)
        except (SyntaxError, UnicodeDecodeError):
            continue
    return found


def test_stand_in_exports_every_module_level_cpu_import_of_the_installed_sglang():
    py = testbed.testbed_python()
    if py is None:
        pytest.fail(f"CPU testbed not set up at {testbed.testbed_dir()}: run `{testbed.setup_command()}`")
    # find_spec locates the package without importing it.
    where = subprocess.run([str(py), "-c", "import importlib.util as u; print(u.find_spec('sglang').submodule_search_locations[0])"],
                           capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    imports = _module_level_sgl_kernel_imports(Path(where.stdout.strip()))
    cpu_names = {(m, n) for m, names in imports.items() for n in names if n.endswith("_cpu")}
    assert ("sgl_kernel", "assign_req_to_token_pool_cpu") in cpu_names  # the scan itself works
    stub = testbed.stub_dir()
    exported = {
        "sgl_kernel": set(_exports(stub / "sgl_kernel" / "__init__.py")),
        "sgl_kernel.mamba": set(_exports(stub / "sgl_kernel" / "mamba.py")),
    }
    missing = sorted(f"{m}.{n}" for m, n in cpu_names if n not in exported.get(m, set()))
    assert not missing, f"sglang imports these *_cpu names at module level but the stand-in lacks them: {missing}"


def _exports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names.extend(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


# ---- setup.sh error paths (no install) --------------------------------------------------------------------------
def _run_setup(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(["bash", str(SETUP), *args], capture_output=True, text=True, timeout=120, env=env,
                          stdin=subprocess.DEVNULL)


def test_setup_unknown_argument_is_usage_error():
    r = _run_setup("--bogus")
    assert r.returncode == 2
    assert "unknown argument '--bogus'" in r.stderr and "--dir" in r.stderr


def test_setup_reports_which_package_pip_could_not_install(tmp_path: Path):
    # A venv whose pip fails the way an unreachable index does; setup.sh must say which package and how to fix.
    _fake_python(
        tmp_path / "venv" / "bin" / "python",
        'case "$*" in\n'
        '  *"-m pip"*) echo "ERROR: No matching distribution found for sglang==0.5.23" >&2; exit 1 ;;\n'
        '  *) exit 0 ;;\n'
        'esac',
    )
    r = _run_setup("--dir", str(tmp_path))
    assert r.returncode == 1
    assert "ERROR" in r.stderr and "sglang==0.5.23" in r.stderr and "package index" in r.stderr
    assert not (tmp_path / testbed.STAMP_NAME).exists()


def test_setup_with_missing_base_python_names_the_flag(tmp_path: Path):
    r = _run_setup("--dir", str(tmp_path / "tb"), "--python", str(tmp_path / "nope"))
    assert r.returncode == 1 and "--python" in r.stderr


# ---- interpreter choice --------------------------------------------------------------------------------------------
@pytest.fixture
def no_testbed(monkeypatch, tmp_path: Path) -> Path:
    d = tmp_path / "empty-testbed"
    monkeypatch.setenv("REPRO_TESTBED_DIR", str(d))
    return d


def test_explicit_python_wins(no_testbed, tmp_path: Path):
    py = _fake_python(tmp_path / "bin" / "python", "exit 0")  # `-c "import sglang"` succeeds
    assert choose_python(str(py), SGLANG) == str(py)


def test_explicit_python_without_sglang_or_not_executable_is_one_clear_line(no_testbed, tmp_path: Path):
    py = _fake_python(tmp_path / "bin" / "python", "exit 1")  # cannot import sglang
    with pytest.raises(InterpreterError, match="cannot import sglang") as e:
        choose_python(str(py), SGLANG)
    assert "\n" not in str(e.value) and "setup.sh" in str(e.value)
    assert choose_python(str(py), SGLANG, require_package=False) == str(py)  # `repro sites` reports missing modules itself
    with pytest.raises(InterpreterError, match="not an executable file"):
        choose_python(str(tmp_path), SGLANG)  # a directory


def test_explicit_python_missing_is_clear_error(no_testbed, tmp_path: Path):
    with pytest.raises(InterpreterError, match="--python"):
        choose_python(str(tmp_path / "missing" / "python"), SGLANG)


def test_current_interpreter_used_when_it_imports_sglang(monkeypatch, no_testbed, tmp_path: Path):
    ok = _fake_python(tmp_path / "withsglang" / "python", "exit 0")  # `-c "import sglang"` succeeds
    monkeypatch.setattr(sys, "executable", str(ok))
    assert choose_python(None, SGLANG) == str(ok)


def test_testbed_used_when_current_interpreter_lacks_sglang(monkeypatch, no_testbed, tmp_path: Path):
    monkeypatch.setattr(sys, "executable", str(_fake_python(tmp_path / "plain" / "python", "exit 1")))
    tb_py = _fake_python(no_testbed / "venv" / "bin" / "python", "exit 0")
    (no_testbed / testbed.STAMP_NAME).write_text("ok\n")
    assert choose_python(None, SGLANG) == str(tb_py)


def test_no_sglang_and_no_testbed_is_one_line_naming_both_fixes(monkeypatch, no_testbed, tmp_path: Path):
    monkeypatch.setattr(sys, "executable", str(_fake_python(tmp_path / "plain" / "python", "exit 1")))
    with pytest.raises(InterpreterError) as e:
        choose_python(None, SGLANG)
    msg = str(e.value)
    assert "\n" not in msg
    assert "--python" in msg and "scripts/cpu_testbed/setup.sh" in msg and "sglang CPU testbed is not set up" in msg


def test_an_engine_without_a_testbed_is_told_to_pass_python(monkeypatch, no_testbed, tmp_path: Path):
    """The base adapter has no CPU testbed: SGLang's is never offered for another engine."""
    from repro.targets.base import AdapterBase, RefLocation

    class _NoTestbed(AdapterBase):
        name = "notestbed"
        ref_location = RefLocation(package="reprofakeengine")

    tb_py = _fake_python(no_testbed / "venv" / "bin" / "python", "exit 0")  # SGLang's testbed is set up ...
    (no_testbed / testbed.STAMP_NAME).write_text("ok\n")
    monkeypatch.setattr(sys, "executable", str(_fake_python(tmp_path / "plain" / "python", "exit 1")))
    with pytest.raises(InterpreterError) as e:  # ... but is not this engine's
        choose_python(None, _NoTestbed())
    assert "notestbed adapter has no CPU testbed; pass --python PATH" in str(e.value) and str(tb_py) not in str(e.value)
    assert _NoTestbed().testbed_python() is None and _NoTestbed().testbed_setup_command() == ""


def test_import_check_runs_in_a_subprocess_not_here():
    assert interpreter.can_import(sys.executable, "sglang") == (
        subprocess.run([sys.executable, "-c", "import sglang"], capture_output=True).returncode == 0
    )
    assert "sglang" not in sys.modules


# ---- HiCache compat layer (scripts/cpu_testbed/compat; loaded by the venv's .pth when REPRO_TESTBED_COMPAT=1) ------
KVCACHEIO_CHECK = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    from repro_testbed_compat.kvcacheio import (
        transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf, transfer_kv_all_layer_direct_lf_pf)

    L, S, H, D, PS = 2, 16, 2, 3, 4
    dev_k = [torch.randn(S, H, D) for _ in range(L)]
    dev_v = [torch.randn(S, H, D) for _ in range(L)]
    # layer_first: host per layer [S, H, D]
    host = [torch.zeros(S, H, D) for _ in range(2 * L)]
    src, dst = torch.tensor([1, 2, 3, 9]), torch.tensor([4, 5, 6, 7])
    transfer_kv_direct(src_layers=dev_k + dev_v, dst_layers=host, src_indices=src, dst_indices=dst, page_size=PS)
    for h, d in zip(host, dev_k + dev_v):
        assert torch.equal(h[dst], d[src])
        assert int((h.abs().sum(dim=(1, 2)) != 0).sum()) == 4   # nothing else written
    back = [torch.zeros(S, H, D) for _ in range(2 * L)]
    transfer_kv_direct(src_layers=host, dst_layers=back, src_indices=dst, dst_indices=src, page_size=PS)
    for b, d in zip(back, dev_k + dev_v):
        assert torch.equal(b[src], d[src])

    # page_first_direct: host [page_num, L, PS, H, D]; device -> host for all layers, then host -> device per layer.
    hk, hv = torch.zeros(S // PS, L, PS, H, D), torch.zeros(S // PS, L, PS, H, D)
    hidx = torch.tensor([4, 5, 6, 7])            # page 1, offsets 0..3
    transfer_kv_all_layer_direct_lf_pf(src_ptrs=dev_k + dev_v, dst_ptrs=[hk, hv], src_indices=src, dst_indices=hidx, page_size=PS)
    for layer in range(L):
        assert torch.equal(hk[1, layer], dev_k[layer][src])
        assert torch.equal(hv[1, layer], dev_v[layer][src])
    assert hk[0].abs().sum() == 0 and hk[2:].abs().sum() == 0
    for layer in range(L):
        out_k, out_v = torch.zeros(S, H, D), torch.zeros(S, H, D)
        transfer_kv_per_layer_direct_pf_lf(src_ptrs=[hk, hv], dst_ptrs=[out_k, out_v], src_indices=hidx,
                                           dst_indices=src, layer_id=layer, page_size=PS)
        assert torch.equal(out_k[src], dev_k[layer][src]) and torch.equal(out_v[src], dev_v[layer][src])
    try:
        transfer_kv_direct(src_layers=dev_k, dst_layers=host, src_indices=src, dst_indices=dst, page_size=PS)
    except ValueError as e:
        assert "layers" in str(e)
    else:
        raise AssertionError("mismatched layer lists accepted")
    print("kvcacheio ok")
    """
)


def test_compat_kv_copy_ops_move_the_right_slots(torch_python: str, tmp_path: Path):
    script = tmp_path / "kv.py"
    script.write_text(KVCACHEIO_CHECK)
    r = subprocess.run([torch_python, str(script), str(testbed.compat_dir())], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "kvcacheio ok" in r.stdout


COMPAT_STATE = (
    "import sys, torch; m = sys.modules.get('repro_testbed_compat'); "
    "print(m is not None, hasattr(torch.cpu.Stream, 'synchronize'), sorted(getattr(m, 'APPLIED', {})))"
)


def _testbed_python_or_fail() -> str:
    py = testbed.testbed_python()
    if py is None or not testbed.is_set_up():
        pytest.fail(f"CPU testbed not set up at {testbed.testbed_dir()}: run `{testbed.setup_command()}`")
    return str(py)


def test_compat_layer_is_inert_without_the_env_switch():
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPRO_TESTBED_COMPAT")}
    r = subprocess.run([_testbed_python_or_fail(), "-c", COMPAT_STATE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "False", "[]"]


def test_compat_layer_loads_from_pth_and_patches_lazily_on_import():
    env = {**os.environ, testbed.COMPAT_ENV: "1", testbed.COMPAT_DIR_ENV: str(testbed.compat_dir())}
    r = subprocess.run([_testbed_python_or_fail(), "-c", COMPAT_STATE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "True True ['torch']"
    assert "repro testbed compat: torch: cpu.Stream.synchronize=no-op" in r.stderr


def _in_testbed_sglang_with_compat(code: str) -> str:
    """Run ``code`` in the testbed interpreter with the compat layer switched on; its stdout (fails on exit != 0)."""
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(testbed.stub_dir()),
           testbed.COMPAT_ENV: "1", testbed.COMPAT_DIR_ENV: str(testbed.compat_dir())}
    r = subprocess.run([_testbed_python_or_fail(), "-W", "ignore", "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.sglang
def test_compat_layer_binds_direct_ops_and_plain_cpu_alloc_into_the_installed_sglang():
    code = (
        "import sys, sglang.srt.mem_cache.pool_host.mha as mha, sglang.srt.mem_cache.pool_host.common as c; "
        "import repro_testbed_compat.kvcacheio as k; "
        "assert all(getattr(mha, n) is getattr(k, n) for n in k.__all__); "
        "assert c.ALLOC_MEMORY_FUNCS['cpu'].__name__ == 'alloc_plain_cpu'; "
        "assert c.ALLOC_MEMORY_FUNCS['cuda'] is c.alloc_with_host_register; print('bound')"
    )
    assert "bound" in _in_testbed_sglang_with_compat(code)


@pytest.mark.sglang
def test_compat_host_pool_builds_storage_bounce_pages_without_cuda():
    """The io-aux thread's storage read builds its pages with the pool's pin_memory; unpinned on CPU it must work
    (it raised "Found no NVIDIA driver" for every L3 read before the compat layer set it False)."""
    code = (
        "import torch, sglang.srt.mem_cache.pool_host.mha as mha; "
        "p = object.__new__(mha.MHATokenToKVPoolHost); "
        "p.layer_num, p.page_size, p.head_num, p.head_dim, p.dtype, p.device = 2, 1, 2, 16, torch.float32, 'cpu'; "
        "p.pin_memory = True; page = p.get_dummy_flat_data_page(); "
        "print('page', page.numel(), p.pin_memory)"
    )
    assert _in_testbed_sglang_with_compat(code).split() == ["page", str(2 * 2 * 1 * 2 * 16), "False"]


# ---- (d) storage queries answer after the scheduler's batch decision of their tick -----------------------------------
QUERY_ORDER_CHECK = textwrap.dedent(
    """
    import sys, threading, time, types
    sys.path.insert(0, sys.argv[1])
    import repro_testbed_compat as c

    sched = types.ModuleType("fake_scheduler")
    class Scheduler:
        def get_next_batch_to_run(self, gate):
            gate.wait(5)   # the admission loop of this tick runs while the test holds the gate
            return "batch"
    Scheduler.__module__ = sched.__name__
    sched.Scheduler = Scheduler
    ctl = types.ModuleType("fake_cache_controller")
    class PrefetchOperation:
        def __init__(self, rid):
            self.rid = rid
    class HiCacheController:
        def _storage_hit_query(self, op):
            return op.rid, time.monotonic()
    for k in (PrefetchOperation, HiCacheController):
        k.__module__ = ctl.__name__
    ctl.PrefetchOperation, ctl.HiCacheController = PrefetchOperation, HiCacheController
    c._patch_scheduler(sched)
    c._patch_prefetch_classes(ctl)
    c._patch_prefetch_classes(ctl)  # idempotent
    assert Scheduler.get_next_batch_to_run.__code__.co_name == "wrapper"

    s, h = Scheduler(), HiCacheController()
    op = PrefetchOperation("r1")                       # submitted in tick 1, before its batch decision
    got = {}
    q = threading.Thread(target=lambda: got.setdefault("q", h._storage_hit_query(op)))
    gate = threading.Event()
    t = threading.Thread(target=lambda: got.setdefault("pass", (s.get_next_batch_to_run(gate), time.monotonic())))
    t.start(); q.start()
    time.sleep(0.3)
    assert "q" not in got, "the query answered before the scheduler's batch decision of its tick"
    gate.set(); t.join(5); q.join(5)
    assert got["q"][0] == "r1" and got["q"][1] >= got["pass"][1], got
    late = PrefetchOperation("r2")                     # after that pass: waits for the next one, bounded
    t0 = time.monotonic()
    assert c.wait_for_pass_after(getattr(late, c.PASS_ATTR), max_wait_s=0.2) is False
    assert 0.15 < time.monotonic() - t0 < 2
    print("ordered", c.passes_done())
    """
)


def test_compat_storage_query_answers_only_after_the_batch_decision_of_its_tick(tmp_path: Path):
    script = tmp_path / "order.py"
    script.write_text(QUERY_ORDER_CHECK)
    r = subprocess.run([sys.executable, str(script), str(testbed.compat_dir())], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["ordered", "1"]
    assert "fake_cache_controller: HiCacheController._storage_hit_query answers after the next batch decision" in r.stderr


def test_compat_storage_query_ordering_can_be_turned_off(tmp_path: Path):
    code = ("import sys, types; sys.path.insert(0, sys.argv[1]); import repro_testbed_compat as c; "
            "m = types.ModuleType('m'); S = type('Scheduler', (), {'get_next_batch_to_run': lambda self: 1}); "
            "m.Scheduler = S; c._patch_scheduler(m); print(S.get_next_batch_to_run.__name__)")
    env = {**os.environ, "REPRO_TESTBED_STORAGE_QUERY_AFTER_PASS": "0"}
    r = subprocess.run([sys.executable, "-c", code, str(testbed.compat_dir())], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "<lambda>"


@pytest.mark.sglang
def test_compat_orders_storage_queries_in_the_installed_sglang():
    code = (
        "import sglang.srt.managers.scheduler as s, sglang.srt.managers.cache_controller as cc; "
        "import sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller as hc; "
        "assert getattr(s.Scheduler.get_next_batch_to_run, '__repro_compat__', False); "
        "assert all(getattr(k._storage_hit_query, '__repro_compat__', False) for k in (cc.HiCacheController, hc.HybridCacheController)); "
        "assert all(getattr(k.__init__, '__repro_compat__', False) for k in (cc.PrefetchOperation, hc.PrefetchOperation)); "
        "print('ordered')"
    )
    assert "ordered" in _in_testbed_sglang_with_compat(code)


@pytest.mark.sglang
def test_compat_layer_switches_off_mooncake_host_tensor_indices_in_the_installed_sglang():
    # With the switch on, the prefill send path pins memory and records a torch.cuda.Event: every prefill rank of a
    # PD server died at its first request on CPU (measured, sglang 0.5.23). The class attribute is True upstream.
    code = (
        "import sglang.srt.disaggregation.mooncake.conn as m; "
        "assert m.MooncakeKVSender.supports_host_tensor_indices is False; "
        "print('switched')"
    )
    assert "switched" in _in_testbed_sglang_with_compat(code)
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(testbed.stub_dir())}
    env = {k: v for k, v in env.items() if not k.startswith("REPRO_TESTBED_COMPAT")}
    r = subprocess.run([_testbed_python_or_fail(), "-W", "ignore", "-c",
                        "import sglang.srt.disaggregation.mooncake.conn as m; print(m.MooncakeKVSender.supports_host_tensor_indices)"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]
