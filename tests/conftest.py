"""Suite-wide fixtures and classification.

* Every test must leave no twt process and no twt-* segment behind, create nothing outside the
  run's temp root (tests/helpers/hygiene.py), and start processes only when marked ``process``.
* ``process`` is applied here, at collection, to every test whose code (the test, its fixtures and
  the test-suite helpers they call, followed through) can start a process: a supervisor
  (``launch``, ``tests.helpers.cluster.supervisor``), a worker, Ray, ``subprocess``,
  ``multiprocessing``, ``os.fork``... So a new test is classified without its author remembering;
  one the scan misses fails at run time with the fix named (mark it, or add its starter to
  :data:`PROCESS_STARTERS`). ``make test-fast`` runs ``-m "not process and not gpu"``.
* Every timeout is scaled by :data:`TIMEOUT_SCALE` (3): timeouts guard against hangs, never
  measure speed, and a loaded machine is slower.
* Tests run longest first: ``slow``, then ``process``, then the rest (each module's tests stay
  together, in order); the hardware check's dry run is started first and read late (below).
* Under pytest-xdist ``make test`` runs ``--dist loadscope``: each module's tests share one
  worker, so a module-scoped fixture (the Ray cluster, the fuzzed supervisor) starts once.
  (``--dist loadgroup`` with ``xdist_group`` marks would be finer, but pytest-xdist 3.8 renames
  node ids through an attribute pytest 9 no longer reads, so its groups are silently ignored.)
"""

from __future__ import annotations

import fcntl
import gc
import importlib
import json
import marshal
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis.configuration as hypothesis_configuration
import pytest

import supervisor.client.launch
from tests.helpers import cpu_profile, gpu_dry_run, hygiene, timeouts, warm_bytecode, xdist_fork, zygote

hygiene.mark_session()


def _read_rewritten_modules_whole() -> None:
    """pytest's cached test modules (their asserts rewritten) read with one ``read``, not through
    ``marshal.load(file)``.

    ``marshal.load`` on a file reads it a field at a time, a method call for each of the tens of
    thousands of objects in a large test module: our ~190 test modules took 0.25 s of CPU to load
    that way against 0.04 s read whole and decoded with ``marshal.loads`` - in every xdist worker,
    since each imports every test module at collection. The same bytes give the same code object
    (``marshal.loads`` ignores what follows the object, as ``load`` leaves it unread). Through
    pytest's internal module global: if a pytest release stops reading with ``marshal.load``, this
    changes nothing - slower, never wrong.
    """
    try:
        from _pytest.assertion import rewrite
    except ImportError:
        return
    if getattr(rewrite, "marshal", None) is not marshal:
        return
    whole = types.ModuleType("marshal", marshal.__doc__)
    whole.__dict__.update({k: v for k, v in vars(marshal).items() if not k.startswith("__")})
    whole.load = lambda file: marshal.loads(file.read())  # type: ignore[attr-defined]
    rewrite.marshal = whole  # type: ignore[attr-defined]


_read_rewritten_modules_whole()
# every launched supervisor is forked from a preloaded interpreter (tests/helpers/zygote.py): a
# fresh one spends ~0.2 s of CPU importing what each of the suite's ~1,000 starts imports again
zygote.install(supervisor.client.launch)

# The fake CUDA driver's real NVRTC compiles (tests/helpers/fake_cuda.py), shared by every process of a
# make test run (inherited by the workers, supervisors, tenants' workers and the GPU check's children)
# through a folder of its temp root: the same two kernel sources were compiled ~60 times in the GPU
# check's dry run and ~80 in the cuda modules, ~0.13 s of CPU each with NVRTC's load. Only under
# tests/run-suite.sh: a bare pytest's temp root is /tmp, kept across runs.
if os.environ.get(hygiene.ROOT_ENV):
    os.environ.setdefault("FAKE_CUDA_NVRTC_CACHE", os.path.join(hygiene.temp_root(), "twt-nvrtc"))

# Hypothesis keeps its example database and constants cache in its home directory (by default
# .hypothesis/ in the checkout): keep it in this run's temp root (make test: fresh every run).
hypothesis_configuration.set_hypothesis_home_dir(os.path.join(hygiene.temp_root(), "twt-hypothesis"))

#: the packages whose modules hypothesis may treat as local (their literals seed its generation);
#: of their files it reads only those its ``is_local_module_file`` accepts: none of tests/
_LOCAL_PACKAGES = ("shared", "supervisor", "worker", "sdk", "tests")


#: set once the session starts: hypothesis's initialisation is over by then
_SESSION_STARTED = threading.Event()


def _warm_hypothesis_unicode() -> None:
    """Hypothesis's Unicode tables for this run, written once (the xdist controller, after the
    session starts) rather than computed by each worker that draws text.

    ``st.text()`` draws from ``characters(codec="utf-8")``, whose code points hypothesis finds by
    encoding and decoding every one of the 1.1 million (``intervals_from_codec``: ~2.8 s of CPU on
    this machine), then keeps in its home directory - this run's temp root, fresh each run. So each
    worker that ran a text-drawing module (the frontend fuzz, the protocol schema) computed it
    again. UTF-8 encodes every code point but the surrogates (U+D800-U+DFFF) and decodes each back
    to itself: the file is written with that, as hypothesis writes it (checked against its own
    computation with hypothesis 6.170: ``[[[0, 55295], [57344, 1114111]], []]``). The category
    table (``charmap``, ~0.2 s) is computed here through hypothesis itself. Through hypothesis's
    internal ``charmap_file``: a release that renames the file reads nothing of this and computes
    it as before - slower, never wrong.
    """
    import gzip

    try:
        from hypothesis.internal import charmap as hypothesis_charmap

        path = hypothesis_charmap.charmap_file("codec-v2-utf-8")
        if not path.exists():
            encodable = [[0, 0xD7FF], [0xE000, sys.maxunicode]]
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_name(f".{path.name}.{os.getpid()}")
            with gzip.GzipFile(part, "wb", mtime=1) as f:
                f.write(json.dumps([encodable, []]).encode())
            os.replace(part, path)
        hypothesis_charmap.charmap()
    except Exception:  # noqa: BLE001 - a cache warm-up: the workers compute what it missed
        return


def _warm_hypothesis_constants() -> None:
    """Fill hypothesis's cache of our modules' constants once, in the xdist controller (a thread).

    Each xdist worker otherwise parses every local module's source for its literals (hypothesis
    seeds generation with them) at collection: ~1 s of CPU per worker, the same result six times.
    With the cache (keyed by each source's hash, in this run's hypothesis home) a worker reads
    it instead. Through hypothesis's internal ``constants_from_module``: if a hypothesis release
    moves it, this warms nothing and each worker parses as before - slower, never wrong.
    """
    try:
        from hypothesis.internal.constants_ast import constants_from_module, is_local_module_file
    except ImportError:
        return
    # hypothesis refuses disk work while pytest initialises (a HypothesisSideeffectWarning, an error
    # here): every file reached before the session starts would be lost to it
    if not _SESSION_STARTED.wait(timeouts.scaled(60)):
        return
    _warm_hypothesis_unicode()
    root = Path(__file__).resolve().parent.parent
    for package in _LOCAL_PACKAGES:
        for path in warm_bytecode.python_sources(root / package):
            # only the files whose constants a worker's hypothesis reads: it leaves out every file
            # below a ``tests`` folder and every ``test_*.py`` (half of our source's bytes, which
            # cost the controller ~1.5 s of CPU to parse for nothing)
            try:
                if not is_local_module_file(str(path)):
                    continue
            except Exception:  # noqa: BLE001 - a cache warm-up: the workers compute what it missed
                continue
            stand_in = types.ModuleType("twt_constants_stand_in")  # only its __file__ is read
            stand_in.__file__ = str(path)
            try:
                constants_from_module(stand_in)
            except Exception:  # noqa: BLE001 - a cache warm-up: the workers compute what it missed
                continue


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        # what the controller has loaded (pytest, its plugins, hypothesis, the conftests) lives as
        # long as it does: out of the collector's walks, which the warm-ups below (every source's
        # syntax tree, the bytecode) would otherwise set off ~11 times over all of it
        gc.freeze()
        # the workers are forked from one interpreter that imports what each imported for itself (the
        # third-party and product modules: ~0.6 s of CPU a worker); it preloads beside the warm-ups
        xdist_fork.install()
        # beside the workers' start-up (interpreter, plugins, test modules: seconds), which it
        # does not delay; they reach the constants at the end of their collection
        threading.Thread(target=_warm_hypothesis_constants, name="twt-warm-constants", daemon=True).start()
        # before the workers start (pytest_sessionstart): each would otherwise compile every test
        # module whose cache is missing (a fresh clone: all of them) - the same ~3 s of CPU 6 times
        started = time.perf_counter()
        rewritten, compiled = warm_bytecode.warm(config, Path(__file__).parent)
        # before pytest's clock starts: the header says what it cost
        _WARMED.append(f"bytecode written before the workers started: {rewritten} rewritten, {compiled} compiled "
                       f"in {time.perf_counter() - started:.1f} s")


#: what the bytecode warm-up did (the xdist controller only), for the run's header
_WARMED: list[str] = []


def pytest_report_header(config: pytest.Config) -> list[str]:
    return _WARMED


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    _SESSION_STARTED.set()  # after hypothesis's own hook: its initialisation has ended


#: callables (``module.qualname``) outside the test suite that start processes when called
PROCESS_STARTERS = frozenset({
    "supervisor.client.launch.launch",
})
#: a module whose use in a test's code means it starts processes
_PROCESS_MODULES = ("subprocess", "multiprocessing", "ray", "pty", "concurrent.futures.process", "asyncio.subprocess")
#: ``os`` functions that start processes
_OS_STARTERS = frozenset({"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "spawnv", "spawnve",
                          "spawnl", "spawnle", "spawnlp", "spawnvp", "execv", "execve"})


def _is_process_module(module: types.ModuleType) -> bool:
    name = module.__name__
    return any(name == m or name.startswith(m + ".") for m in _PROCESS_MODULES)


# cuda-pathfinder runs ``ldconfig -p`` once per process when it is first imported (ctypes'
# find_library): a library's probe, not a process a test starts. Imported here, before any test, so
# the run-time guard below never blames whichever test happens to load the CUDA libraries first.
try:
    import cuda.pathfinder._dynamic_libs.load_dl_linux  # noqa: F401
except ImportError:  # not installed (a CPU-only set-up without the cuda extras): nothing to probe
    pass

#: code followed by the scan: the suite's and the packages' own (functions; classes of the suite)
_OUR_PACKAGES = ("tests", "supervisor", "worker", "shared")


def _module_of(obj: Any) -> str:
    return str(obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "") or "")


def _ours(obj: Any, packages: tuple[str, ...] = _OUR_PACKAGES) -> bool:
    top = _module_of(obj).split(".", 1)[0]
    return top in packages


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents  # raises ValueError while the cell is empty
    except ValueError:
        return False
    return True


#: verdicts of :func:`_starts_processes` kept across tests (each holds its function, so the id stays
#: its own): the ~1,850 tests share their helpers and fixtures, and scanning each one afresh per
#: test was a third of every xdist worker's collection (~2 s of CPU per worker)
_VERDICTS: dict[int, tuple[object, bool]] = {}
#: how many times a scan stopped at a function already being scanned (a cycle in the call graph);
#: a "no" reached past such a stop may depend on the cycle's other half, so it is not kept
_CUTS = [0]


def _starts_processes(func: Callable[..., Any], seen: set[int]) -> bool:
    """Whether ``func`` (a test, fixture or helper) can start a process: a scan of the names its
    code uses (module globals, local imports, closures), followed into our own functions."""
    func = getattr(func, "__wrapped__", func)
    known = _VERDICTS.get(id(func))
    if known is not None and known[0] is func:
        return known[1]
    if id(func) in seen:
        _CUTS[0] += 1
        return False
    seen.add(id(func))
    cuts = _CUTS[0]
    verdict = _scan(func, seen)
    if verdict or _CUTS[0] == cuts:  # a "yes" always holds; a "no" only when no cycle was cut
        _VERDICTS[id(func)] = (func, verdict)
    return verdict


def _scan(func: Callable[..., Any], seen: set[int]) -> bool:
    """:func:`_starts_processes`'s scan of one function (not yet judged)."""
    code = getattr(func, "__code__", None)
    if code is None:
        return False
    namespace: dict[str, Any] = getattr(func, "__globals__", {})
    names: set[str] = set()
    for c in _codes(code):
        names.update(c.co_names)
    objs = [c.cell_contents for c in (getattr(func, "__closure__", None) or ()) if _filled(c)]
    for n in names:
        if n not in namespace and any(n == m or n.startswith(m + ".") for m in _PROCESS_MODULES):
            return True  # imported inside the function
        obj = namespace.get(n, sys.modules.get(n))
        if obj is None:
            obj = _our_module(n)
        if obj is not None:
            objs.append(obj)
    modules = [o for o in objs if isinstance(o, types.ModuleType)]
    if any(m is os for m in modules) and names & _OS_STARTERS:
        return True
    looked: set[int] = set()
    while modules:  # attributes used on our own modules: cluster.supervisor(...), check_gpu.Held(...)
        module = modules.pop()
        if _ours(module) and id(module) not in looked:
            looked.add(id(module))
            found = [getattr(module, n) for n in names if hasattr(module, n)]
            objs += found
            modules += [o for o in found if isinstance(o, types.ModuleType)]
    if any(_is_starter(obj) for obj in objs):
        return True
    return any(_ours(obj) and _follow(obj, seen) for obj in objs)


def _our_module(name: str) -> types.ModuleType | None:
    """Our module ``name`` (imported inside a function, maybe not yet imported at all)."""
    if "." not in name or name.split(".", 1)[0] not in _OUR_PACKAGES:
        return None
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - not a module (an attribute path), or one that fails: nothing to follow
        return None


def _is_starter(obj: Any) -> bool:
    if isinstance(obj, types.ModuleType):
        return _is_process_module(obj)
    if f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}" in PROCESS_STARTERS:
        return True
    module = str(getattr(obj, "__module__", "") or getattr(type(obj), "__module__", ""))
    return any(module == m or module.startswith(m + ".") for m in _PROCESS_MODULES)


def _follow(obj: Any, seen: set[int]) -> bool:
    if isinstance(obj, type):
        if id(obj) in seen or not _ours(obj, ("tests",)):  # a class of the packages: too broad to follow
            return False
        seen.add(id(obj))
        return any(_follow(v, seen) for v in vars(obj).values())
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        return any(_follow(f, seen) for f in (obj.fget, obj.fset) if f is not None)
    wrapped = getattr(obj, "__wrapped__", None)  # functools.cache and friends
    if wrapped is not None and not isinstance(obj, types.FunctionType):
        return _follow(wrapped, seen)
    if isinstance(obj, types.FunctionType):
        return _starts_processes(obj, seen)
    return False


def _item_starts_processes(item: pytest.Item) -> bool:
    seen: set[int] = set()
    funcs: list[Any] = [getattr(item, "obj", None)]
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        funcs += [d.func for d in defs if _ours(d.func)]
    return any(f is not None and _starts_processes(f, seen) for f in funcs)


#: every test's timeout (pytest-timeout: the ini default or its own mark) times this. A timeout is
#: a hang guard sized on a quiet machine; a loaded one (CPU burners, parallel workers) runs a
#: test several times slower, and a passing test never waits for its timeout.
TIMEOUT_SCALE = timeouts.TIMEOUT_SCALE


def _scale_timeout(item: pytest.Item, default: float) -> None:
    mark = item.get_closest_marker("timeout")
    value = mark.args[0] if mark and mark.args else (mark.kwargs.get("timeout") if mark else None)
    if value is None:
        value = default
    if value and TIMEOUT_SCALE != 1:
        item.add_marker(pytest.mark.timeout(float(value) * TIMEOUT_SCALE), append=False)  # the closest


def _process_verdicts(items: list[pytest.Item]) -> dict[str, bool]:
    """:func:`_item_starts_processes` for each test not marked ``process`` by hand, by node id.

    Every xdist worker collects the same tests, and the scan is a third of a worker's collection
    (~1 s of CPU each). So under xdist the first worker to take the lock scans and writes the
    verdicts to a file of this run (in its temp root, named after xdist's run id); the others wait
    on the lock (a blocked ``flock``: no CPU) and read them, scanning only a test the file lacks.
    """
    unmarked = [item for item in items if not item.get_closest_marker("process")]
    run_id, root = os.environ.get("PYTEST_XDIST_TESTRUNUID"), os.environ.get("PYTEST_TWT_ROOT")
    if not (run_id and root and os.path.isdir(root)):
        return {item.nodeid: _item_starts_processes(item) for item in unmarked}
    path = os.path.join(root, f"twt-process-marks-{run_id[:16]}.json")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path, encoding="utf-8") as f:
                known: dict[str, bool] = json.load(f)
        except (OSError, ValueError):
            known = {}
        missing = {item.nodeid: _item_starts_processes(item) for item in unmarked if item.nodeid not in known}
        if missing:
            known.update(missing)
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(known, f)
            os.replace(path + ".tmp", path)
    return known


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    default_timeout = float(config.getini("timeout") or 0)
    verdicts = _process_verdicts(items)
    for item in items:
        _scale_timeout(item, default_timeout)
        if not item.get_closest_marker("process") and verdicts[item.nodeid]:
            item.add_marker(pytest.mark.process)
    # Longest first (a stable sort: each module's tests stay together and in order): the longest
    # module (the Ray cluster's: ~4 min of a loaded run's 5, which once started 26 s late behind
    # another slow module on its worker and ended the run), then the slow and process-starting
    # tests while every worker is free, the ~1,250 quick ones fill the end, so no worker is left
    # alone with a long test at the end of a parallel run.
    # The hardware check's dry run (tests/helpers/gpu_dry_run.py: ~35 s, mostly its timed rounds) is
    # run once for every module that reads it, by the first to ask; the others wait for it on a
    # lock. So the first such module goes first (its worker runs the check while the others work)
    # and the other readers after every other process test, when the result is there to read:
    # before, all of them came early and up to four workers sat blocked on the lock at once.
    first = _dry_run_producer(items)
    items.sort(key=lambda item: _run_order(item, first))


def _dry_run_producer(items: list[pytest.Item]) -> types.ModuleType | None:
    """The first module (in collection order) that reads the hardware check's dry run."""
    return next((m for m in dict.fromkeys(map(_module_of_item, items)) if _reads_the_dry_run(m)), None)


def _module_of_item(item: pytest.Item) -> types.ModuleType | None:
    module = getattr(item, "module", None)
    return module if isinstance(module, types.ModuleType) else None


def _reads_the_dry_run(module: types.ModuleType | None) -> bool:
    return module is not None and getattr(module, "gpu_dry_run", None) is gpu_dry_run


def _run_order(item: pytest.Item, dry_run_first: types.ModuleType | None = None) -> float:
    module = _module_of_item(item)
    if module is not None and module is dry_run_first:
        return 0
    if _reads_the_dry_run(module):
        return 2.5
    for rank, marker in enumerate(("longest", "slow", "process")):
        if item.get_closest_marker(marker):
            return rank
    return 3


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything collection made (every test module and what it imported, the items, their
    fixtures' definitions, hypothesis's strategies) lives until the session ends: moved out of the
    garbage collector's walks (``gc.freeze``, after one collection of what collection left), so
    each full collection during the run walks only what the tests made since. In an xdist worker
    those are some 100,000 objects or more, and a full collection walks them all each time.

    Then the collector's thresholds are raised from (700, 10, 10) to (2000, 20, 20): what the
    tests make is mostly short-lived, and a full collection walks every object they keep alive
    (the in-process tests of tests/supervisor, tests/shared and tests/worker, ~25 s of CPU: 31 full
    collections took 0.60-0.66 s, 10 took 0.19 s; all the collections 0.99-1.05 s, then 0.56-0.57
    s). Only the collector's cadence changes: a test that needs a collection asks for one."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(2000, 20, 20)


_CPU_LOG = os.environ.get(cpu_profile.ENV)
if _CPU_LOG:  # CPU per test, for finding where the suite's time goes (tests/helpers/cpu_profile.py)
    _RECORDER = cpu_profile.Recorder(f"{_CPU_LOG}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}",
                                     zygote.server_pids)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        _RECORDER.start()
        yield
        _RECORDER.stop(item.nodeid)


def pytest_unconfigure(config: pytest.Config) -> None:
    zygote.stop()
    xdist_fork.stop()


def _children() -> set[int]:
    """Our child processes, less multiprocessing's resource tracker (started once, on the first
    use of shared memory by whichever test comes first: not a test's doing) and the suite's
    zygote (started by the first launch, kept for the session)."""
    found = set()
    for pid in hygiene.descendants() - zygote.server_pids():
        args = hygiene.cmdline(pid)  # [] once it is gone or a zombie: as psutil's errors were, skipped
        if args and not any("resource_tracker" in a for a in args):
            found.add(pid)
    return found


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    before = hygiene.baseline(processes=request.node.get_closest_marker("process") is not None)
    children = _children()
    hygiene.take_events()  # what happened between tests (a module fixture's set-up) is no test's doing
    yield
    outside, starts = hygiene.take_events()
    new_children = _children() - children
    segments, processes = hygiene.leaks(before)
    # Clean up so one leak does not cascade into every later test.
    hygiene.kill_processes(processes)
    hygiene.unlink_segments(segments)
    problems = []
    if segments or processes:
        problems.append(f"leaked segments={sorted(segments)} processes={sorted(p for p, _ in processes)}")
    if outside:
        problems.append(f"wrote outside its temp root {hygiene.temp_root()}: {sorted(set(outside))[:10]}"
                        " (use tmp_path or tempfile: make test points $TMPDIR into a fresh directory per run)")
    if (starts or new_children) and not request.node.get_closest_marker("process"):
        problems.append(f"started a process ({sorted(set(starts)) or 'a child'}) but is not marked `process`: "
                        "add its starter to PROCESS_STARTERS in tests/conftest.py, or mark it "
                        "@pytest.mark.process (make test-fast leaves such tests out)")
    if problems:
        pytest.fail(f"{request.node.nodeid} " + "; ".join(problems), pytrace=False)
