"""``twt build`` on hostile sources, its warnings, and its lock on Zig's cache.

A source may name any file (``#include`` / ``#embed`` of ``/etc/shadow``,
``..``, a macro, a symlink beside it), be named like an option, or keep the
compiler busy forever; none of that may put a byte from outside the source's
directory into a module, write a path of its choosing, or leave a compiler
process behind. The compiler's warnings are shown when the build succeeds,
and concurrent builds on one Zig cache take turns, saying so.
"""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from supervisor.tools import build as builder
from supervisor.tools import build_guard
from supervisor.cli import main
from supervisor.tools.build import BuildError, build_module
from supervisor.tools.build_guard import cache_lock
from tests.helpers import zygote
from tests.helpers.cluster import wait_for
from tests.helpers.sdk_build import SdkBuilder, opened_during, opened_in, seed_sandbox_cache

pytestmark = [pytest.mark.timeout(300), pytest.mark.process]

SECRET = b"TOP-SECRET-" + uuid.uuid4().hex.encode()
EXPORT = '#include "tensorwasm.h"\nTWT_EXPORT(f) int f(void) { return (int)sizeof data; }\n'


def layout(tmp_path: Path) -> tuple[Path, Path]:
    """``src/`` (the tenant's directory) beside ``private/secret.txt`` (0600, outside it)."""
    src, private = tmp_path / "src", tmp_path / "private"
    src.mkdir()
    private.mkdir()
    secret = private / "secret.txt"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return src, secret


def embedding(how: str) -> str:
    return f"static const unsigned char data[] = {{\n{how}\n}};\n" + EXPORT


# named from outside: refused by the list of files the compiler read; named relatively: not in the staged
# copy of the source's directory (``..`` there is the build's temp dir), so the compile fails (zig's clang
# then reports a lost dependency file rather than the missing embed: any failure will do)
OUTSIDE = "outside the source's directory"
NOT_THERE = "compiling failed"


@pytest.mark.parametrize(("directive", "why"), [
    ('#embed "{secret}"', OUTSIDE),  # absolute
    ('#define WHERE "{secret}"\n#embed WHERE', OUTSIDE),  # through a macro
    ('#include "{secret}"', OUTSIDE),  # an include (its bytes would become tokens, or an error message)
    ('#embed "../private/secret.txt"', NOT_THERE),  # up and out
    ('#define WHERE "../private/secret.txt"\n#embed WHERE', NOT_THERE),
])
def test_embed_or_include_outside_the_source_directory_is_refused(tmp_path: Path, directive: str,
                                                                  why: str) -> None:
    src, secret = layout(tmp_path)
    source = src / "tenant.c"
    source.write_text(embedding(directive.format(secret=secret)))
    out = tmp_path / "tenant.wasm"
    with pytest.raises(BuildError) as refused:
        build_module([source], out)
    assert why in str(refused.value) + refused.value.output
    assert SECRET not in (str(refused.value) + refused.value.output).encode()
    assert not out.exists()


def test_a_symlink_beside_the_source_is_not_followed(tmp_path: Path) -> None:
    src, secret = layout(tmp_path)
    (src / "data.bin").symlink_to(secret)
    (src / "tenant.c").write_text(embedding('#embed "data.bin"'))
    (src / "root.zig").write_text('const data = @embedFile("data.bin");\nexport fn f() u8 { return data[0]; }\n')
    for source in ("tenant.c", "root.zig"):
        out = tmp_path / f"{source}.wasm"
        with pytest.raises(BuildError) as refused:
            build_module([src / source], out)
        assert SECRET not in refused.value.output.encode()
        assert not out.exists()


def test_a_source_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    """``tenant.c -> /etc/shadow``: compiled, its lines would come back in the compiler's errors (and its
    folder, /etc, would be the one copied); refused before anything reads it."""
    src, secret = layout(tmp_path)
    (src / "tenant.c").symlink_to(secret)
    with pytest.raises(BuildError, match="a symlink") as refused:
        build_module([src / "tenant.c"], tmp_path / "t.wasm")
    assert SECRET not in (str(refused.value) + refused.value.output).encode()
    assert not (tmp_path / "t.wasm").exists()


def test_zig_cannot_embed_outside_its_directory_or_cimport(tmp_path: Path) -> None:
    src, secret = layout(tmp_path)
    cases = {
        "abs.zig": f'const data = @embedFile("{secret}");\nexport fn f() u8 {{ return data[0]; }}\n',
        "up.zig": 'const data = @embedFile("../private/secret.txt");\nexport fn f() u8 { return data[0]; }\n',
        "cimp.zig": f'const c = @cImport(@cInclude("{secret}"));\nexport fn f() i32 {{ return 0; }}\n',
    }
    for name, text in cases.items():
        (src / name).write_text(text)
        with pytest.raises(BuildError) as refused:
            build_module([src / name], tmp_path / "z.wasm")
        assert SECRET not in (str(refused.value) + refused.value.output).encode()
        assert not (tmp_path / "z.wasm").exists()
    with pytest.raises(BuildError, match="@cImport is not supported"):
        build_module([src / "cimp.zig"], tmp_path / "z.wasm")


def test_a_source_named_like_an_option_is_a_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("-opwned.c").write_text('#include "tensorwasm.h"\nTWT_EXPORT(f) int f(void) { return 7; }\n')
    result = build_module([Path("-opwned.c")], tmp_path / "named.wasm")
    assert result.exports == ("f",)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["-opwned.c", "named.wasm"]  # no "pwned.c" written


def _alive(marker: str) -> list[int]:
    """Pids of running (not zombie) processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def test_a_compiler_past_its_timeout_is_killed_with_its_whole_group(tmp_path: Path) -> None:
    marker = f"selfinc{uuid.uuid4().hex[:12]}"
    source = tmp_path / f"{marker}.c"
    # each level includes itself twice: 2^60 inclusions, the compiler never finishes on its own
    source.write_text(f'#if __INCLUDE_LEVEL__ < 60\n#include "{source.name}"\n#include "{source.name}"\n#endif\n'
                      "int x;\n")
    try:
        with pytest.raises(BuildError, match="did not finish within 2 s"):
            build_module([source], tmp_path / "never.wasm", timeout_s=2.0)
        # killed and reaped inside build_module; the wait only covers the kernel finishing a SIGKILL
        wait_for(lambda: not _alive(marker), what="the compiler's processes to be gone")
    finally:
        for pid in _alive(marker):  # without the fix: the zig clang child kept running; stop it here
            os.kill(pid, 9)


WARNS = '#include "tensorwasm.h"\nTWT_EXPORT(f) int f(int a) { int unused; if (a) return 1; }\n'


def test_warnings_are_printed_when_the_build_succeeds_and_werror_fails_it(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "warns.c"
    src.write_text(WARNS)
    out = tmp_path / "warns.wasm"
    assert main(["build", str(src), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "wrote" in captured.out and out.exists()
    assert "non-void function does not return a value" in captured.err and "unused variable" in captured.err
    assert f"{src}:2" in captured.err  # named as the user's file, not the staged copy
    out.unlink()
    assert main(["build", str(src), "-o", str(out), "-Werror"]) == 1
    assert "error: non-void function does not return a value" in capsys.readouterr().err
    assert not out.exists()


def test_a_flood_of_warnings_is_kept_to_its_head_and_tail(tmp_path: Path) -> None:
    src = tmp_path / "noisy.c"
    body = "".join(f"    int unused_{i};\n" for i in range(6000))  # ~1.5 MB of -Wunused-variable
    src.write_text('#include "tensorwasm.h"\nTWT_EXPORT(f) int f(void) {\n' + body + "    return 0;\n}\n")
    result = build_module([src], tmp_path / "noisy.wasm")
    assert result.exports == ("f",)
    assert "unused_0" in result.warnings and "bytes of compiler output cut" in result.warnings
    # kept: 3/4 of MAX_OUTPUT, then the staged folder's name in each message becomes the source's own
    assert len(result.warnings.encode()) < 2 * build_guard.MAX_OUTPUT


def test_concurrent_builds_on_one_cache_wait_for_each_other_and_both_succeed(tmp_path: Path) -> None:
    """The test holds the cache's lock while two ``twt build`` processes start: each says it waits,
    naming this process; released, both finish with their module."""
    cache = builder.cache_dir()
    procs: list[tuple[subprocess.Popen[bytes], Path, Path]] = []
    try:
        with cache_lock(cache, timeout_s=60.0):
            for i in range(2):
                src = tmp_path / f"turn{i}" / "turn.c"
                src.parent.mkdir()
                src.write_text(f'#include "tensorwasm.h"\nTWT_EXPORT(f) int f(void) {{ return {i}; }}\n')
                err = tmp_path / f"turn{i}.err"
                with open(err, "wb") as sink:
                    # forked from the suite's zygote where it can be (the lock's wait is the point)
                    proc = zygote.popen([sys.executable, "-m", "supervisor", "build", str(src), "-o",
                                         str(tmp_path / f"turn{i}.wasm")], stdout=subprocess.DEVNULL, stderr=sink)
                procs.append((proc, err, tmp_path / f"turn{i}.wasm"))
            for proc, err, _ in procs:
                wait_for(lambda err=err: b"waiting for another build" in err.read_bytes() or  # type: ignore[misc]
                         proc.poll() is not None, what="the build to say it waits")
                text = err.read_text()
                assert f"waiting for another build of the Zig cache {cache} (pid {os.getpid()})" in text, text
        for proc, err, out in procs:
            assert proc.wait(timeout=240) == 0, err.read_text()
            assert out.exists()
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _nobody_can_run(zig: Path, user: pwd.struct_passwd) -> bool:
    try:
        done = subprocess.run([str(zig), "version"], capture_output=True, timeout=60, user=user.pw_uid,
                              group=user.pw_gid, extra_groups=[], cwd="/")
    except PermissionError:
        return False
    return done.returncode == 0


_BOXED = '#include <stdio.h>\n#include "tensorwasm.h"\nTWT_EXPORT(f) int f(void) {{ return printf("{}\\n"); }}\n'


@pytest.mark.skipif(os.geteuid() != 0, reason="--sandbox switches to the user nobody, which needs root")
def test_a_sandboxed_build_runs_the_compiler_as_nobody(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    zig = Path(builder._zig()[0])
    if not _nobody_can_run(zig, nobody):
        pytest.skip(f"nobody cannot run {zig} (the checkout is under a directory only its owner enters)")
    # a cache nobody can reach (under the run's 0711 temp root), seeded from the user's so no wasi-libc build:
    # its objects hard links nobody can read but not write, what a build writes nobody's own copies
    holder = Path(tempfile.mkdtemp())
    holder.chmod(0o711)
    cache = holder / "zig"
    source = builder.cache_dir()
    probe_dir = tmp_path / "probe"
    (probe_dir / "tmp").mkdir(parents=True)
    (probe_dir / "probe.c").write_text(_BOXED.format(uuid.uuid4().hex))

    def probe() -> None:
        """A trusted build of the same kind, as the sandbox's compile runs it (the toolchain's own
        lib path), on the user's cache: what it opens there is what the seed needs of ``h``."""
        cmd = builder.compile_command([probe_dir / "probe.c"], probe_dir / "probe.wasm", cache=source)
        with cache_lock(source, timeout_s=builder.LOCK_TIMEOUT_S):
            done = subprocess.run(cmd, cwd=probe_dir, env=builder._compiler_env(probe_dir, source),
                                  capture_output=True, text=True, timeout=builder.BUILD_TIMEOUT_S)
        assert done.returncode == 0, done.stderr

    seed_sandbox_cache(source, cache, nobody.pw_uid, nobody.pw_gid, probe=probe)
    # what the build makes is what is newer than this mark (find(1), not a Python walk: without inotify
    # the seed links every object of the user's cache); the seed's links keep their files' times
    mark = holder / "mark"
    mark.touch()
    src = tmp_path / "boxed.c"
    src.write_text(_BOXED.format(uuid.uuid4().hex))
    result = build_module([src], tmp_path / "boxed.wasm", sandbox=True, cache=cache)
    assert result.exports == ("f",) and result.wasi
    def newer(*test: str) -> str:
        done = subprocess.run(["find", str(cache), "-newer", str(mark), *test, "-print", "-quit"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done
        return done.stdout
    assert newer(), "the sandboxed compiler wrote nothing into its cache"
    assert newer("!", "-user", str(nobody.pw_uid)) == ""  # what the compiler made, it made as nobody
    assert os.lstat(cache).st_uid == nobody.pw_uid
    # the seed's objects shared with the user's cache (hard links) are nobody's to read, never to write
    linked = subprocess.run(["find", str(cache / "o"), "-type", "f", "-links", "+1", "-print", "-quit"],
                            capture_output=True, text=True, timeout=120)
    assert linked.returncode == 0 and linked.stdout, "the seed shares no object with the user's cache"
    shared = subprocess.run(["find", str(cache / "o"), "-type", "f", "-links", "+1", "(", "-user", str(nobody.pw_uid),
                             "-o", "-perm", "-o+w", ")", "-print", "-quit"], capture_output=True, text=True, timeout=120)
    assert shared.returncode == 0 and shared.stdout == "", shared


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the seeded cache to nobody needs root")
def test_the_sandbox_cache_seed_shares_objects_read_only_and_copies_what_a_build_writes(tmp_path: Path) -> None:
    """The seed of the sandboxed build's cache (tests.helpers.sdk_build.seed_sandbox_cache): no file
    the invoking user's builds read becomes writable by nobody."""
    nobody = pwd.getpwnam("nobody")
    source = tmp_path / "user-zig"
    for rel, mode in (("o/aa/libc.a", 0o644), ("o/bb/open.o", 0o666), ("h/0123", 0o644), ("z/4567", 0o644),
                      ("tmp/scratch", 0o644)):
        path = source / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rel.encode())
        path.chmod(mode)
    holder = tmp_path / "holder"
    holder.mkdir(mode=0o711)
    cache = holder / "zig"
    seed_sandbox_cache(source, cache, nobody.pw_uid, nobody.pw_gid)
    shared = cache / "o" / "aa" / "libc.a"  # an object: the user's own file, linked, read-only to nobody
    assert shared.stat().st_ino == (source / "o" / "aa" / "libc.a").stat().st_ino
    assert shared.stat().st_uid == 0 and not shared.stat().st_mode & 0o022
    assert (cache / "o" / "aa").stat().st_uid == 0  # its directory too: nothing can be put in it
    private = cache / "o" / "bb" / "open.o"  # a file others may write is not shared, but copied
    assert private.stat().st_ino != (source / "o" / "bb" / "open.o").stat().st_ino
    assert private.stat().st_uid == nobody.pw_uid and private.read_bytes() == b"o/bb/open.o"
    for rel in ("h/0123", "z/4567"):  # what a build writes: nobody's own copies
        copy = cache / rel
        assert copy.read_bytes() == rel.encode() and copy.stat().st_uid == nobody.pw_uid
        assert copy.stat().st_ino != (source / rel).stat().st_ino
    assert {p.stat().st_uid for p in (cache, cache / "o", cache / "h", cache / "z")} == {nobody.pw_uid}
    assert not (cache / "tmp").exists()
    assert (source / "o" / "aa" / "libc.a").stat().st_uid == 0  # the user's cache unchanged


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the seeded cache to nobody needs root")
def test_a_probe_limits_the_seed_to_the_manifests_and_objects_it_opened(tmp_path: Path) -> None:
    """With a probe, ``h`` gets nobody's copies of the manifests the probe opened, and ``o`` the object
    folders it read from (the user's files, linked), and no other."""
    nobody = pwd.getpwnam("nobody")
    source = tmp_path / "user-zig"
    for rel in ("h/used", "h/timestamp", "h/stale", "o/aa/libc.a", "o/bb/crt1.o", "o/cc/stale.o", "o/dd/open.o"):
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        (source / rel).write_bytes(rel.encode())
    (source / "o" / "dd" / "open.o").chmod(0o666)
    holder = tmp_path / "holder"
    holder.mkdir(mode=0o711)

    def probe() -> None:
        for rel in ("h/used", "h/timestamp", "o/aa/libc.a", "o/bb/crt1.o", "o/dd/open.o"):
            with open(source / rel, "rb"):
                pass

    assert opened_in(source / "h", probe) == {"used", "timestamp"}
    assert opened_during(probe, source / "h", source / "o") == ({"used", "timestamp"}, {"aa", "bb", "dd"})
    seed_sandbox_cache(source, holder / "zig", nobody.pw_uid, nobody.pw_gid, probe=probe)
    h, o = holder / "zig" / "h", holder / "zig" / "o"
    assert sorted(os.listdir(h)) == ["timestamp", "used"]
    assert (h / "used").read_bytes() == b"h/used" and (h / "used").stat().st_uid == nobody.pw_uid
    assert (h / "used").stat().st_ino != (source / "h" / "used").stat().st_ino
    assert sorted(os.listdir(o)) == ["aa", "bb", "dd"] and o.stat().st_uid == nobody.pw_uid
    for rel in ("aa/libc.a", "bb/crt1.o"):  # the user's files, linked, in folders of the user's
        assert (o / rel).stat().st_ino == (source / "o" / rel).stat().st_ino and (o / rel).parent.stat().st_uid == 0
    private = o / "dd" / "open.o"  # one others may write: nobody's own copy, as without a probe
    assert private.stat().st_ino != (source / "o" / "dd" / "open.o").stat().st_ino
    assert private.stat().st_uid == nobody.pw_uid and private.read_bytes() == b"o/dd/open.o"


def test_sandbox_without_root_is_refused_plainly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    src = tmp_path / "a.c"
    src.write_text('#include "tensorwasm.h"\nTWT_EXPORT(f) int f(void) { return 1; }\n')
    with pytest.raises(BuildError, match="needs root"):
        build_module([src], tmp_path / "a.wasm", sandbox=True)


def test_the_suites_builder_compiles_each_guest_once_per_run(tmp_path: Path) -> None:
    """Two builders over one shared folder (two xdist workers of a run): one compile, the same bytes."""
    shared = tmp_path / "shared"
    first, second = SdkBuilder(tmp_path / "gw0", shared), SdkBuilder(tmp_path / "gw1", shared)
    text = f'#include "tensorwasm.h"\nTWT_EXPORT(f) int f(void) {{ return {uuid.uuid4().int % 1000}; }}\n'
    wasm = first.source("once.c", text)
    assert second.source("once.c", text) == wasm
    assert (first.builds, second.builds) == (1, 0)
    assert first.source("once.c", text) == wasm and first.builds == 1  # and the memo within one worker
