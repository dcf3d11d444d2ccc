"""``gradest_lab.storage.files``: atomic replaces, whole-record logs and early output checks.

Failures are provoked for real: a writer that raises midway, a folder without write
permission, a file in the way of a folder, a file-size limit (``RLIMIT_FSIZE``, what a
full disk looks like to ``write``) in a child process, and a log with a torn last line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from gradest_lab.storage.files import (
    JsonLog,
    OutputError,
    atomic_save,
    atomic_write,
    atomic_write_text,
    check_output_dir,
    check_output_file,
    remove_stale_temporaries,
)

ROOT = os.name == "posix" and os.geteuid() == 0


# The child sets its own file-size limit after its imports (which may write bytecode) and
# just before the write under test; a preexec_fn would run Python code in a fork of this
# multi-threaded process, which can deadlock before the exec. SIGXFSZ ignored: EFBIG
# instead of a kill.
FILE_SIZE_LIMIT = (
    "import resource, signal\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
)

# A child that cannot import this checkout's gradest_lab.storage.files as nobody exits with
# this code.
UNREACHABLE = 77


def run_unprivileged(code: str) -> subprocess.CompletedProcess:
    """``python -c code``; as root (who ignores file permissions) with uid/gid nobody.

    As root, skips the calling test where nobody cannot run this checkout: the interpreter,
    the checkout or its packages lie under a folder nobody may enter (a checkout in root's
    own home, a clone in ``mktemp -d``). Then either the exec fails (raised here, in the
    parent) or the child cannot import this checkout's ``gradest_lab.storage.files`` (it exits with
    ``UNREACHABLE`` before running ``code``).
    """

    import gradest_lab.storage.files

    probe = (
        "import sys\n"
        "try:\n"
        "    import gradest_lab.storage.files\n"
        "except BaseException as err:\n"
        "    print(f'cannot import gradest_lab.storage.files: {type(err).__name__}: {err}',"
        " file=sys.stderr)\n"
        f"    sys.exit({UNREACHABLE})\n"
        f"if gradest_lab.storage.files.__file__ != {gradest_lab.storage.files.__file__!r}:\n"
        "    print(f'imports gradest_lab.storage.files from {gradest_lab.storage.files.__file__}',"
        " file=sys.stderr)\n"
        f"    sys.exit({UNREACHABLE})\n"
    )
    try:
        # user= and group=, not a preexec_fn: those are set in C between fork and exec,
        # where Python code in a fork of this multi-threaded process can deadlock.
        nobody = {"user": 65534, "group": 65534} if ROOT else {}
        done = subprocess.run(
            [sys.executable, "-c", probe + code], capture_output=True, text=True, **nobody
        )
    except PermissionError as err:
        if not ROOT:
            raise
        pytest.skip(
            f"nobody cannot run {sys.executable} ({err.strerror}): it lies under a folder "
            "an unprivileged user cannot enter"
        )
    if ROOT and done.returncode == UNREACHABLE:
        reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no message"
        pytest.skip(
            f"nobody cannot import this checkout's gradest ({reason}): it lies under a "
            "folder an unprivileged user cannot enter"
        )
    python_failed = done.returncode and "Permission denied" in done.stderr
    if ROOT and python_failed and "gradest" not in done.stderr:
        pytest.skip("the interpreter is not readable by an unprivileged user here")
    return done


def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_atomic_write_replaces_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "a.txt"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("error", [RuntimeError("writer broke"), KeyboardInterrupt()])
def test_a_writer_failing_midway_keeps_the_previous_file(tmp_path, error):
    target = tmp_path / "a.txt"
    atomic_write_text(target, "good")

    def half_then_fail(file):
        file.write(b"partial")
        raise error

    with pytest.raises(type(error)):
        atomic_write(target, half_then_fail)
    assert target.read_text() == "good"
    assert leftovers(tmp_path) == []


def test_a_full_disk_is_one_clear_line_and_keeps_the_previous_file(tmp_path):
    """A child process with a 4 KiB file-size limit writes a 64 KiB checkpoint."""
    target = tmp_path / "model.pt"
    atomic_save({"small": 1}, target)
    before = target.read_bytes()
    script = (
        "import sys, torch\n"
        "from gradest_lab.storage.files import atomic_save, OutputError\n"
        f"{FILE_SIZE_LIMIT.format(limit=4096)}"
        "try:\n"
        f"    atomic_save({{'big': torch.zeros(16384)}}, {str(target)!r})\n"
        "except OutputError as err:\n"
        "    print(err); sys.exit(2)\n"
    )

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stdout.strip().startswith(f"cannot write {str(target)!r}: the file is larger")
    assert "previous file is unchanged" in done.stdout
    assert len(done.stdout.strip().splitlines()) == 1
    assert target.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_output_checks_fail_before_any_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match=r"--out '.*file' is a file; pass a folder path"):
        check_output_dir(blocker, what="--out")
    with pytest.raises(OutputError, match=r"cannot be written: a part of the path is a file"):
        check_output_dir(blocker / "sub", what="--out")
    with pytest.raises(OutputError, match=r"out '.*' is a folder; pass a file path"):
        check_output_file(tmp_path, what="out")
    made = check_output_dir(tmp_path / "new" / "deeper", what="--out")
    assert made.is_dir() and leftovers(made) == []


def test_a_folder_another_process_creates_meanwhile_is_not_a_file(tmp_path, monkeypatch):
    """Two data-parallel ranks check one checkpoint folder at once: the folder the other
    rank creates between this rank's look and its decision is a folder, not "a file"."""
    from gradest_lab.storage import files

    folder = tmp_path / "ckpt"
    look = files._existing_kind

    def look_then_the_other_rank_creates_it(path, what, **kwargs):
        kind = look(path, what, **kwargs)
        folder.mkdir(exist_ok=True)
        return kind

    monkeypatch.setattr(files, "_existing_kind", look_then_the_other_rank_creates_it)
    assert check_output_dir(folder, what="checkpoint_dir") == folder
    assert folder.is_dir()


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_a_read_only_folder_is_refused_up_front(tmp_path):
    base = tempfile.mkdtemp()  # outside tmp_path, whose parents nobody may not enter
    try:
        os.chmod(base, 0o755)
        folder = os.path.join(base, "ro")
        os.mkdir(folder, 0o555)
        os.chmod(folder, 0o555)
        code = (
            "from gradest_lab.storage.files import (\n"
            "    OutputError, check_output_dir, atomic_write_text\n"
            ")\n"
            f"for call in (lambda: check_output_dir({folder!r}, what='--out'),\n"
            f"             lambda: atomic_write_text({folder!r} + '/a.txt', 'x')):\n"
            "    try:\n"
            "        call()\n"
            "    except OutputError as err:\n"
            "        print(err)\n"
        )
        done = run_unprivileged(code)
        lines = done.stdout.strip().splitlines()
        assert len(lines) == 2, done.stdout + done.stderr
        assert (
            lines[0] == f"--out {folder!r} cannot be written: permission denied; pass a "
            "folder you can write to"
        )
        assert lines[1].startswith(f"cannot write {folder + '/a.txt'!r}: permission denied")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_json_log_appends_whole_records_and_drops_a_torn_tail(tmp_path):
    path = tmp_path / "log.jsonl"
    log = JsonLog(path)
    log.append({"step": 0})
    log.append({"step": 1})
    with open(path, "ab") as file:  # a writer killed mid-record by something else
        file.write(b'{"step": 2, "half')
    reopened = JsonLog(path)
    assert reopened.records() == [{"step": 0}, {"step": 1}]
    reopened.append({"step": 2})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
    reopened.keep(lambda record: record["step"] < 1)
    assert JsonLog(path).records() == [{"step": 0}]


def test_json_log_cuts_back_a_short_write(tmp_path):
    path = tmp_path / "log.jsonl"
    JsonLog(path).append({"step": 0})
    size = path.stat().st_size
    script = (
        "import sys\n"
        "from gradest_lab.storage.files import JsonLog, OutputError\n"
        f"{FILE_SIZE_LIMIT.format(limit=size + 100)}"
        "try:\n"
        f"    JsonLog({str(path)!r}).append({{'step': 1, 'pad': 'x' * 5000}})\n"
        "except OutputError as err:\n"
        "    print(err); sys.exit(2)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert "previous records are intact" in done.stdout
    assert JsonLog(path).records() == [{"step": 0}]
    assert path.read_bytes().endswith(b"\n")


def test_stale_temporaries_are_removed(tmp_path):
    (tmp_path / ".step_000001.pt.abc123.tmp").write_bytes(b"half")
    (tmp_path / "step_000001.pt").write_bytes(b"kept")
    removed = remove_stale_temporaries(tmp_path)
    assert [p.name for p in removed] == [".step_000001.pt.abc123.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001.pt"]
