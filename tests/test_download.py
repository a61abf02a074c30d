"""Downloads against a real HTTP server on 127.0.0.1: verified, atomic, once per folder, clear failures."""

import collections
import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from conftest import cli_env, run_cli
from datafiles import ONE_THREAD, make_splits, md5s, source_for, write_files
from mnist_ddp import cli
from mnist_ddp.common.config import DataConfig
from mnist_ddp.common.errors import UserError
from mnist_ddp.data import datasets
from mnist_ddp.data.download import LEAST_RATE, DownloadError, fetch

HOLD_S = 120  # the longest the server holds a download: a hang guard, not a timing assertion
DRIP_S = 0.1  # a dripping server's pause between bytes


@dataclass
class Server:
    """What the server serves and how it misbehaves; `hits` counts requests per file name."""

    url: str = ""
    files: dict[str, bytes] = field(default_factory=dict)
    short: set[str] = field(default_factory=set)  # Content-Length says more than the body holds
    stall: set[str] = field(default_factory=set)  # answers only when the test ends
    drip: dict[str, str] = field(default_factory=dict)  # name → "headers" or "body": sent a byte every DRIP_S
    # The first request is answered only once this says so (or another request arrives): see `hold_first`.
    hold_first_until: Callable[[], bool] | None = None
    hits: collections.Counter = field(default_factory=collections.Counter)
    released: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def hold_first(self, until: Callable[[], bool]) -> None:
        """Hold the first request until `until()` is true: whatever a client does meanwhile certainly happens
        while that download is in flight. A second request ends the hold too (so a broken lock fails the test
        instead of hanging it), and so does a hang guard."""
        deadline = time.monotonic() + HOLD_S
        while not until() and sum(self.hits.values()) == 1 and time.monotonic() < deadline \
                and not self.released.is_set():
            time.sleep(0.01)


@pytest.fixture
def server() -> Iterator[Server]:
    state = Server()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            folder, _, name = self.path.rpartition("/")
            with state.lock:
                state.hits[name] += 1
                first = sum(state.hits.values()) == 1
            if name in state.stall:
                state.released.wait(30)
            if first and state.hold_first_until is not None:
                state.hold_first(state.hold_first_until)
            body = state.files.get(name) if folder == "/mnist" else None
            if body is None:
                self.send_error(404)
                return
            if name in state.drip:
                head = f"HTTP/1.0 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                if state.drip[name] == "body":
                    self.wfile.write(head)
                for byte in (head if state.drip[name] == "headers" else b"") + body:
                    if state.released.wait(DRIP_S):
                        return
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body) + (1000 if name in state.short else 0)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # keep pytest's output clean
            pass

    class Quiet(http.server.ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, *args: object) -> None:  # a client that gave up (timeout) is expected
            pass

    httpd = Quiet(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}/mnist/"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield state
    state.released.set()
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: Server) -> dict[str, Path]:
    """Test files on the server, a Source with their MD5s as 'mnist', and an empty working dir."""
    files = write_files(tmp_path / "published", make_splits())
    server.files = {name: path.read_bytes() for name, path in files.items()}
    monkeypatch.setitem(datasets.SOURCES, "mnist", source_for(md5s(files), (server.url,)))
    monkeypatch.setattr(datasets, "SYSTEM_DIRS", ())
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return files


def _request(**kw: object) -> DataConfig:
    return DataConfig("mnist", **{"download_timeout": 10.0, **kw})  # type: ignore[arg-type]


def _leftovers(folder: Path) -> list[str]:
    """Files in `folder` other than the lock and the decoded files' cache: partial downloads would show up here."""
    return sorted(p.name for p in folder.iterdir() if p.name not in (".download.lock", "decoded")) \
        if folder.exists() else []


def test_download_verifies_and_stores(published: dict[str, Path], server: Server) -> None:
    data = datasets.load(_request())
    expected = make_splits()
    assert torch.equal(data.train.images, expected["train"][0]) and torch.equal(data.test.images, expected["test"][0])
    assert "downloaded" in data.where
    target = Path("data/mnist")
    assert _leftovers(target) == sorted(published)
    assert all((target / name).read_bytes() == path.read_bytes() for name, path in published.items())
    assert server.hits == dict.fromkeys(published, 1)
    datasets.load(_request())  # found on disk now: no second download
    assert server.hits == dict.fromkeys(published, 1)


def test_download_goes_to_data_dir(published: dict[str, Path], server: Server, tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    data = datasets.load(_request(data_dir=folder))
    assert data.where == f"{folder} (downloaded)"
    assert _leftovers(folder) == sorted(published) and not Path("data").exists()


def test_second_mirror_is_tried(published: dict[str, Path], server: Server) -> None:
    dead = server.url.replace("/mnist/", "/gone/")
    datasets.load(_request(mirrors=(dead, server.url)))
    assert server.hits == dict.fromkeys(published, 2)  # one 404 from the dead mirror, then the good one


def test_md5_mismatch_leaves_nothing(published: dict[str, Path], server: Server) -> None:
    name = "t10k-labels-idx1-ubyte.gz"
    server.files[name] = server.files[name][:-1] + bytes([server.files[name][-1] ^ 1])
    with pytest.raises(datasets.DataNotFound, match=f"{name}: MD5 [0-9a-f]{{32}} does not match"):
        datasets.load(_request())
    assert name not in _leftovers(Path("data/mnist"))
    assert not [n for n in _leftovers(Path("data/mnist")) if "part" in n]


def test_partial_download_resumes_where_it_stopped(published: dict[str, Path], server: Server) -> None:
    name = "t10k-labels-idx1-ubyte.gz"
    good = server.files.pop(name)
    with pytest.raises(datasets.DataNotFound, match="HTTP 404"):
        datasets.load(_request())
    server.files[name] = good
    datasets.load(_request())
    assert server.hits[name] == 2 and server.hits["train-images-idx3-ubyte.gz"] == 1


@pytest.mark.parametrize("misbehaviour", ["404", "truncated", "stalled"])
def test_fetch_failures_are_clear_and_atomic(tmp_path: Path, server: Server, misbehaviour: str) -> None:
    server.files = {} if misbehaviour == "404" else {"f.gz": b"x" * 5000}
    if misbehaviour == "truncated":
        server.short.add("f.gz")
    if misbehaviour == "stalled":
        server.stall.add("f.gz")
    expected = {"404": "HTTP 404", "truncated": "got 5000 of 6000 bytes",
                "stalled": "no answer within --download-timeout 0.5 s"}[misbehaviour]
    dest = tmp_path / "f.gz"
    with pytest.raises(DownloadError, match=expected) as e:
        fetch(server.url + "f.gz", dest, "0" * 32, timeout=0.5 if misbehaviour == "stalled" else 30)
    assert str(e.value).startswith(server.url + "f.gz: ")
    assert list(tmp_path.iterdir()) == []  # neither the file nor a partial one


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_mirror_that_drips_its_answer_is_left_in_one_sentence(tmp_path: Path, server: Server, part: str) -> None:
    """A byte every DRIP_S never lets a read time out; once twice --download-timeout has passed the answer must keep
    up LEAST_RATE, headers included, or the download is left. The drip is short: without the rule the download would
    end in a few seconds with the MD5's complaint instead."""
    server.files, server.drip = {"f.gz": b"x" * 40}, {"f.gz": part}
    dest = tmp_path / "f.gz"
    with pytest.raises(DownloadError, match=r": sent \d+ bytes in [0-9.]+ s, slower than 16 KiB/s once "
                                            r"twice --download-timeout 0.5 s had passed$"):
        fetch(server.url + "f.gz", dest, "0" * 32, timeout=0.5)
    assert list(tmp_path.iterdir()) == []


def test_the_help_says_the_rate_a_download_must_keep(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert f"must keep up {LEAST_RATE >> 10} KiB/s" in " ".join(capsys.readouterr().out.split())


def test_fetch_keeps_the_old_file_on_failure(tmp_path: Path, server: Server) -> None:
    dest = tmp_path / "f.gz"
    dest.write_bytes(b"the old one")
    server.files = {"f.gz": b"new"}
    with pytest.raises(DownloadError, match="MD5"):
        fetch(server.url + "f.gz", dest, "0" * 32, timeout=5)
    assert dest.read_bytes() == b"the old one" and [p.name for p in tmp_path.iterdir()] == ["f.gz"]


# A child process asking for the data, as a rank does at start.
_CHILD = """
import sys
from mnist_ddp.data import datasets
from mnist_ddp.common.config import DataConfig
datasets.SOURCES["mnist"] = datasets.Source(**eval(sys.argv[1]))
data = datasets.load(DataConfig("mnist", mirrors=(sys.argv[2],), download_timeout=float(sys.argv[3])))
print(int(data.train.labels.sum()), int(data.test.labels.sum()), data.where)
"""


def _flocks(path: Path) -> dict[str, list[int]]:
    """The pids holding (`held`) and waiting for (`waiting`) a flock on `path`, from the kernel's /proc/locks:
    `1: FLOCK ADVISORY WRITE <pid> <maj>:<min>:<inode> 0 EOF`, each waiter on a line with `->` after the number."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return {"held": [], "waiting": []}
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    found: dict[str, list[int]] = {"held": [], "waiting": []}
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        waiter = fields[1] == "->"
        kind, pid, file = fields[1 + waiter], fields[4 + waiter], fields[5 + waiter]
        if kind == "FLOCK" and file == where:
            found["waiting" if waiter else "held"].append(int(pid))
    return found


def test_two_processes_download_once(published: dict[str, Path], server: Server, tmp_path: Path) -> None:
    """The first download is held by the server until the other process is seen by the kernel waiting on the
    folder's lock (held by the first): the two certainly overlap, and the second waits instead of downloading."""
    seen: list[dict[str, list[int]]] = []  # the lock's holder and waiter, when the hold ended

    def one_waits_for_the_other() -> bool:
        now = _flocks(Path("data/mnist/.download.lock"))
        if now["held"] and now["waiting"]:
            seen.append(now)
        return bool(seen)
    server.hold_first_until = one_waits_for_the_other
    source = datasets.SOURCES["mnist"]
    spec = repr({"name": source.name, "torchvision_dir": source.torchvision_dir, "mirrors": source.mirrors,
                 "md5": source.md5, "classes": source.classes})
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, spec, server.url, str(HOLD_S + 60)], cwd=Path.cwd(),
                                 env=cli_env(ONE_THREAD), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for _ in range(2)]
    outs = [child.communicate(timeout=HOLD_S + 120) for child in children]
    assert [c.returncode for c in children] == [0, 0], outs
    expected = make_splits()
    sums = f"{int(expected['train'][1].sum())} {int(expected['test'][1].sum())}"
    assert all(out.startswith(sums) for out, _ in outs), outs
    assert server.hits == dict.fromkeys(published, 1)  # every file fetched once: by the lock's holder alone
    assert len(seen) == 1 and sorted(seen[0]["held"] + seen[0]["waiting"]) == sorted(c.pid for c in children), seen
    assert _leftovers(Path("data/mnist")) == sorted(published)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_and_no_data_is_one_paragraph_exit_2(tmp_path: Path) -> None:
    offline = f"http://127.0.0.1:{_closed_port()}/"
    r = run_cli("train", "--dataset", "mnist", "--mirror", offline, "--data-dir", str(tmp_path / "nothing"),
                "--no-progress", "--out", str(tmp_path / "run"), cwd=tmp_path, env=ONE_THREAD, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for said in ("mnist was not found in", str(tmp_path / "nothing"), "the download failed", offline,
                 "--data-dir", "--dataset synthetic"):
        assert said in lines[0]


def test_auto_falls_back_to_synthetic_in_one_line(tmp_path: Path) -> None:
    offline = f"http://127.0.0.1:{_closed_port()}/"
    r = run_cli("train", "--dataset", "auto", "--mirror", offline, "--train-samples", "200", "--test-samples",
                "100", "--epochs", "1", "--no-progress", "--no-plots", "--out", str(tmp_path / "run"),
                cwd=tmp_path, env=ONE_THREAD, timeout=120)
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if "fell back" in line]
    assert len(said) == 1 and said[0].startswith("data: synthetic"), r.stdout
    # One sentence: what failed, what it used instead, how to give the files; not the mirrors' URLs and errno texts.
    for part in ("MNIST is not here and its download failed", "fell back to the built-in digits", "--data-dir FOLDER"):
        assert part in said[0], said[0]
    assert "http" not in said[0] and "rrno" not in said[0] and said[0].count(";") == 1, said[0]
    assert "mnist was not found" not in r.stdout  # the short reason, not the whole error paragraph


def test_auto_does_not_hide_a_corrupt_mnist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    files = write_files(tmp_path / "data" / "mnist", make_splits())
    files["t10k-images-idx3-ubyte.gz"].write_bytes(b"junk")
    with pytest.raises(UserError, match=re.escape("t10k-images-idx3-ubyte.gz")):
        datasets.load(DataConfig("auto", download=False))


def test_explicit_mnist_never_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "SYSTEM_DIRS", ())
    with pytest.raises(datasets.DataNotFound, match="downloads are off"):
        datasets.load(DataConfig("mnist", download=False))
    assert datasets.load(DataConfig("auto", download=False, train_samples=10, test_samples=10)).name \
        == "synthetic"


def _distinct(seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return make_splits(n_train=8 + seed, n_test=4, seed=seed)


@pytest.mark.parametrize("layout", ["{d}", "{d}/mnist", "{d}/MNIST/raw", "data/mnist", "data/MNIST/raw"])
@pytest.mark.parametrize("gz", [True, False])
def test_lookup_layouts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str, gz: bool) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "SYSTEM_DIRS", ())
    folder = tmp_path / layout.format(d="given")
    write_files(folder, _distinct(1), gz=gz)
    data = datasets.load(DataConfig("mnist", data_dir=Path("given"), download=False))
    assert Path(data.where).resolve() == folder and len(data.train.labels) == 9


def test_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--data-dir, then ./data/<name>, then torchvision's ./data/MNIST/raw, then system folders."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "SYSTEM_DIRS", (tmp_path / "system",))
    places = ["given", "data/mnist", "data/MNIST/raw", "system/mnist"]
    for seed, place in enumerate(places):
        write_files(tmp_path / place, _distinct(seed))
    for seed, place in enumerate(places):
        data = datasets.load(DataConfig("mnist", data_dir=Path("given"), download=False))
        assert Path(data.where).resolve() == tmp_path / place and len(data.train.labels) == 8 + seed
        for path in (tmp_path / place).glob("*.gz"):
            path.unlink()


def test_flat_data_folder_is_not_taken_for_a_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """./data itself could hold anything: MNIST files there must not be read as Fashion-MNIST."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "SYSTEM_DIRS", ())
    write_files(tmp_path / "data", _distinct(0))
    with pytest.raises(datasets.DataNotFound):
        datasets.load(DataConfig("fashion-mnist", download=False))
    write_files(tmp_path / "data" / "FashionMNIST" / "raw", _distinct(2))
    assert len(datasets.load(DataConfig("fashion-mnist", download=False)).train.labels) == 10


def test_test_only_needs_only_the_t10k_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "SYSTEM_DIRS", ())
    write_files(tmp_path / "t10k", _distinct(0), only=("test",))
    with pytest.raises(datasets.DataNotFound):
        datasets.load(DataConfig("mnist", data_dir=tmp_path / "t10k", download=False))
    data = datasets.load(DataConfig("mnist", data_dir=tmp_path / "t10k", download=False, test_only=True))
    assert len(data.test.labels) == 4 and len(data.train.labels) == 0
