"""Owner-only folders and files, whatever the umask."""

import os
import stat

import pytest

from feedback.core.files import open_private, private_dir, private_file


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture(params=[0o022, 0o277])  # the usual umask; one that would leave a file its owner cannot write
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_created_folders_and_files_are_owner_only(tmp_path, umask):
    (tmp_path / "shared").mkdir(mode=0o755)
    os.chmod(tmp_path / "shared", 0o755)
    d = private_dir(tmp_path / "shared" / "a" / "b")
    assert [mode(p) for p in (tmp_path / "shared" / "a", d)] == [0o700, 0o700]
    assert mode(tmp_path / "shared") == 0o755  # it existed: the operator's choice stays
    assert private_file(d / "f") and mode(d / "f") == 0o600 and (d / "f").read_bytes() == b""
    with open_private(d / "g") as f:
        f.write(b"secret")
    assert mode(d / "g") == 0o600 and (d / "g").read_bytes() == b"secret"
    os.chmod(d / "f", 0o640)
    assert not private_file(d / "f") and mode(d / "f") == 0o640  # an existing file keeps its mode
    with pytest.raises(NotADirectoryError):
        private_dir(d / "g")
