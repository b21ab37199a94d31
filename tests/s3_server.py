"""A real S3 server for the object-store tests: SeaweedFS, built from its Go module.

`seaweedfs_binary` builds `weed` once with the Go toolchain (CI machines have Go) into the user's
cache, `<cache_dir>/seaweedfs/<version>/weed`; later sessions reuse it. `go install module@version`
refuses this module (its go.mod has replace directives), so the module is downloaded at the
pinned version and built as the main module. The build is CPU-bound: about 640 s of CPU time
(measured: 550 s user + 90 s system), so a few minutes on 2 idle cores, once per machine.

`start` runs `weed server -s3` (master, volume server, filer and S3 gateway in one process) on
free ports of 127.0.0.1 with a throwaway data folder and one access key, and waits until the S3
gateway answers; it takes a few seconds.

`python -m tests.s3_server` builds it ahead of the tests with progress (`make test` does, so the
build never counts against a test's timeout); it needs only the standard library and Go.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SEAWEEDFS = "github.com/seaweedfs/seaweedfs"
SEAWEEDFS_VERSION = "v0.0.0-20261109003541-7506e5f91cd6"


def cache_dir() -> Path:
    """Flywheel's download cache, as the settings resolve it: FLYWHEEL_CACHE_DIR, else the XDG cache."""
    if explicit := os.environ.get("FLYWHEEL_CACHE_DIR"):
        return Path(explicit).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "flywheel"


def seaweedfs_binary(cache: Path, progress: Callable[[str], None] = print) -> Path:
    """`weed` at the pinned version, built into `cache` the first time (a few minutes). One build
    at a time: a second caller (CI starts the build beside the install, then `make test` asks
    for it) waits for the first one's, then uses it."""
    out = cache / "seaweedfs" / SEAWEEDFS_VERSION / "weed"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / ".build.lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress("waiting for the SeaweedFS build another process runs")
            fcntl.flock(lock, fcntl.LOCK_EX)
        return out if out.is_file() else _build(out, progress)


def _build(out: Path, progress: Callable[[str], None]) -> Path:
    go = shutil.which("go")
    if go is None:
        raise RuntimeError(
            "the object-store tests build SeaweedFS with Go: install Go 1.26 or newer (SeaweedFS's go.mod asks for 1.26.6)"
        )
    progress(f"building SeaweedFS {SEAWEEDFS_VERSION} with {go} (once; a few minutes) into {out}")
    t0 = time.monotonic()
    found = subprocess.run(  # outside any Go module: the cache folder
        [go, "mod", "download", "-json", f"{SEAWEEDFS}@{SEAWEEDFS_VERSION}"],
        capture_output=True,
        text=True,
        cwd=out.parent,
    )
    if found.returncode != 0:
        raise RuntimeError(f"go mod download {SEAWEEDFS}@{SEAWEEDFS_VERSION} failed: {found.stderr.strip()[-2000:]}")
    source = json.loads(found.stdout)["Dir"]
    partial = out.with_name("weed.partial")
    build = subprocess.Popen(
        [go, "build", "-v", "-trimpath", "-ldflags=-s -w", "-o", str(partial), "./weed"],
        cwd=source,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert build.stdout is not None
    tail: list[str] = []
    for built, line in enumerate(build.stdout, 1):  # -v names each package as it is compiled
        tail = (tail + [line.rstrip()])[-20:]
        if built % 250 == 0:
            progress(f"building SeaweedFS: {built} packages, {time.monotonic() - t0:.0f} s")
    if build.wait() != 0:
        raise RuntimeError("building SeaweedFS failed:\n" + "\n".join(tail))
    partial.rename(out)  # whole, or not there
    progress(f"built SeaweedFS in {time.monotonic() - t0:.0f} s")
    return out


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    proc: subprocess.Popen
    log: Path
    start_s: float

    def storage_options(self) -> dict:
        """s3fs's keyword arguments for this server (what `store.s3` settings turn into)."""
        return {"endpoint_url": self.endpoint, "key": self.access_key, "secret": self.secret_key}

    def stop(self) -> None:
        """Stop the server (its data folder is thrown away, so it need not shut down gracefully)."""
        from tests.helpers import scaled

        self.proc.terminate()
        try:
            self.proc.wait(timeout=scaled(5))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start(binary: Path, folder: Path) -> S3Server:
    """`weed server -s3` on free ports with one identity and a fresh bucket; waits until it answers."""
    import s3fs

    from tests.helpers import free_port, scaled

    key, secret = "flywheel-test", uuid.uuid4().hex
    config = folder / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "flywheel",
                        "credentials": [{"accessKey": key, "secretKey": secret}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    (folder / "data").mkdir()
    port = {
        name: free_port()
        for name in ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc", "debug")
    }
    args = [
        str(binary),
        "server",
        f"-dir={folder / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-filer",
        "-s3",
        f"-s3.config={config}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",
        "-volume.max=8",
        "-volume.preStopSeconds=0",  # stop at once: nothing here needs a graceful hand-over
        f"-debug.port={port['debug']}",
        *(
            f"-{name}.port{'.grpc' if grpc else ''}={port[name + ('.grpc' if grpc else '')]}"
            for name in ("master", "volume", "filer", "s3")
            for grpc in (False, True)
        ),
    ]
    log = folder / "weed.log"
    t0 = time.monotonic()
    proc = subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=folder)
    server = S3Server(f"http://127.0.0.1:{port['s3']}", key, secret, f"flywheel-{uuid.uuid4().hex[:8]}", proc, log, 0.0)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **server.storage_options())
    deadline = time.monotonic() + scaled(120)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"SeaweedFS exited with {proc.returncode}; its log: {log}\n{log.read_text()[-3000:]}")
        try:
            fs.mkdir(server.bucket)
            fs.pipe_file(f"{server.bucket}/.ready", b"1")
            break
        except Exception as e:  # not up yet: connection refused, or the filer not ready
            if time.monotonic() >= deadline:
                server.stop()
                raise RuntimeError(f"SeaweedFS did not answer within {scaled(120):.0f} s ({e}); its log: {log}") from e
            time.sleep(0.25)
    server.start_s = time.monotonic() - t0
    return server


if __name__ == "__main__":
    try:
        path = seaweedfs_binary(cache_dir(), progress=lambda msg: print(msg, flush=True))
    except RuntimeError as e:
        sys.exit(f"error: {e}")
    print(f"SeaweedFS for the object-store tests: {path}", file=sys.stderr)
