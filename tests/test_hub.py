"""`-m ORG/NAME` against a local hub (tests.support.hub_server) with the real huggingface_hub client: what
is downloaded and where, the cache and offline use, a broken download resumed, hub errors, --revision, provenance in
manifest.json, the disk-space check and --dry-run. Builds run as `python -m builder_plugin` with the environment a
user sets (HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE, HF_TOKEN)."""

from __future__ import annotations

import collections
import filecmp
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import builder_plugin
from builder_plugin.layout import MANIFEST_FILE
from tests.support.hub_server import LocalHub

REPO = "org/phi4mm"
NEEDED = {"config.json", "generation_config.json", "preprocessor_config.json", "tokenizer.json",
          "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "model.safetensors.index.json"}
# What a real model repository also holds and a build of the original layout does not need.
DECOYS = {
    "README.md": b"# Phi-4-multimodal-instruct\n",
    ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    "onnx/model.onnx": os.urandom(64_000),
    "onnx/model.onnx.data": os.urandom(300_000),
    "vision-lora/adapter_config.json": b'{"r": 256, "lora_alpha": 512}',
    "vision-lora/adapter_model.safetensors": os.urandom(200_000),
    "speech-lora/adapter_config.json": b'{"r": 320, "lora_alpha": 640}',
    "speech-lora/adapter_model.safetensors": os.urandom(200_000),
    "modeling_phi4mm.py": b"# remote code\n",
    "processing_phi4mm.py": b"# remote code\n",
    "figures/multi_image.png": os.urandom(50_000),
    "examples/what_is_shown_in_this_image.wav": os.urandom(80_000),
}
BUILD = ("-p", "fp32", "--components", "embedding", "--no-progress")  # the cheapest build the CLI allows


def _publish(folder: Path, checkpoint: Path, extra: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True)
    for item in checkpoint.rglob("*"):  # linked, not copied; a file `extra` replaces is written in its own right
        rel = item.relative_to(checkpoint).as_posix()
        if item.is_file() and rel not in extra:
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).symlink_to(item)
    for rel, data in extra.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path):
    root = tmp_path_factory.mktemp("hub")
    with LocalHub() as server:
        server.v1 = server.add_commit(REPO, _publish(root / "v1", tiny_checkpoint, DECOYS), tags=("v1",))
        generation = json.loads((tiny_checkpoint / "generation_config.json").read_text())
        later = {**DECOYS, "generation_config.json": json.dumps({**generation, "temperature": 0.25}).encode()}
        (root / "v2").mkdir()
        server.main = server.add_commit(REPO, _publish(root / "v2" / "repo", tiny_checkpoint, later))
        llama = root / "llama"
        llama.mkdir()
        (llama / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
        (llama / "model.safetensors").write_bytes(os.urandom(100_000))
        server.add_commit("org/llama", llama)
        server.add_commit("org/gated", _publish(root / "gated", tiny_checkpoint, {}))
        server.set_gated("org/gated")
        server.add_commit("org/down", _publish(root / "down", tiny_checkpoint, {}))
        yield server


def run(hub: LocalHub, hf_home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"}
    root = str(Path(builder_plugin.__file__).resolve().parents[1])  # this copy of the package, from any folder
    path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    full_env = {**clean, "HF_ENDPOINT": hub.endpoint, "HF_HOME": str(hf_home), "HF_HUB_DISABLE_TELEMETRY": "1",
                "PYTHONWARNINGS": "ignore", "PYTHONPATH": path, **env}
    hf_home.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "builder_plugin", *args], capture_output=True, text=True,
                          env=full_env, timeout=600, cwd=hf_home.parent)  # run from the folder HF_HOME is in


@pytest.fixture
def in_process(hub: LocalHub, monkeypatch, tmp_path: Path):
    """The CLI in this process, faster than `run` for runs that read the environment when they start (the hub
    endpoint, HF_TOKEN) and download to -c."""
    import contextlib
    import io

    from builder_plugin import cli

    for name in [k for k in os.environ if k.startswith("HF_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)  # what it read at import

    def call(*args: str, token: str | None = None) -> subprocess.CompletedProcess:
        if token:
            monkeypatch.setenv("HF_TOKEN", token)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main([*args, "-c", str(tmp_path / "cache")])
        return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())

    return call


def one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def shards(checkpoint: Path) -> set[str]:
    return {p.name for p in checkpoint.glob("model-*.safetensors")}


def manifest(package: Path) -> dict:
    return json.loads((package / MANIFEST_FILE).read_text())


@pytest.fixture(scope="module")
def first_build(hub: LocalHub, tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path):
    """One build from the hub into an empty Hugging Face cache (HF_HOME), with the log of what it fetched."""
    work = tmp_path_factory.mktemp("first")
    hub.clear_log()
    result = run(hub, work / "hf", "-m", REPO, "-o", str(work / "out"), "-p", "fp32", "--components", "text",
                 "--no-progress")
    return work, result, hub.downloads()


def test_downloads_exactly_what_a_build_needs_into_the_hf_cache(first_build, tiny_checkpoint: Path,
                                                                hub: LocalHub) -> None:
    work, result, downloads = first_build
    assert result.returncode == 0, result.stderr
    assert sorted(downloads) == sorted(set(downloads))  # each file once
    assert set(downloads) == NEEDED | shards(tiny_checkpoint)
    assert not set(downloads) & set(DECOYS)
    snapshot = work / "hf" / "hub" / "models--org--phi4mm" / "snapshots" / hub.main
    for name in shards(tiny_checkpoint) | {"tokenizer.json", "config.json"}:
        assert filecmp.cmp(snapshot / name, tiny_checkpoint / name, shallow=False), name
    assert not (work / "cache_dir").exists()  # not in the folder the command ran from: in HF_HOME's cache
    source = manifest(work / "out")["source"]
    assert source == {"repository": REPO, "revision": "main", "commit": hub.main, "endpoint": hub.endpoint}


def test_second_run_and_offline_run_download_nothing(first_build, hub: LocalHub) -> None:
    work, first, _ = first_build
    assert first.returncode == 0, first.stderr
    hub.clear_log()
    again = run(hub, work / "hf", "-m", REPO, "-o", str(work / "again"), *BUILD)
    assert again.returncode == 0, again.stderr
    assert hub.downloads() == []
    hub.clear_log()
    offline = run(hub, work / "hf", "-m", REPO, "-o", str(work / "offline"), *BUILD, HF_HUB_OFFLINE="1")
    assert offline.returncode == 0, offline.stderr
    assert hub.log == []  # not one request
    assert manifest(work / "offline")["source"]["commit"] == hub.main


def test_offline_with_nothing_cached_says_so(hub: LocalHub, tmp_path: Path) -> None:
    hub.clear_log()
    result = run(hub, tmp_path / "hf", "-m", REPO, "-o", str(tmp_path / "out"), *BUILD, HF_HUB_OFFLINE="1")
    one_line_error(result, "offline", "HF_HUB_OFFLINE=1", REPO, "not in the cache")
    assert hub.log == [] and not (tmp_path / "out").exists()


def test_a_download_cut_mid_shard_fails_cleanly_and_the_next_run_resumes(hub: LocalHub, tmp_path: Path,
                                                                         tiny_checkpoint: Path) -> None:
    big = max(shards(tiny_checkpoint), key=lambda n: (tiny_checkpoint / n).stat().st_size)
    size = (tiny_checkpoint / big).stat().st_size
    hub.clear_log()
    hub.cut(REPO, big, at_byte=size // 2, times=None)  # the connection drops there, and again on every retry
    try:
        failed = run(hub, tmp_path / "hf", "-m", REPO, "-o", str(tmp_path / "out"), *BUILD)
    finally:
        hub.clear_faults()
    one_line_error(failed, big, "run the same command again to resume")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no partial package either
    kept = list((tmp_path / "hf" / "hub" / "models--org--phi4mm" / "blobs").glob("*.incomplete"))
    assert len(kept) == 1 and 0 < kept[0].stat().st_size < size
    kept_bytes = kept[0].stat().st_size
    hub.clear_log()
    hub.cut(REPO, big, at_byte=size * 4 // 5, times=1)  # and once more in the resumed run: resumed within the run
    try:
        resumed = run(hub, tmp_path / "hf", "-m", REPO, "-o", str(tmp_path / "out"), *BUILD)
    finally:
        hub.clear_faults()
    assert resumed.returncode == 0, resumed.stderr
    transfers = [r for r in hub.log if r.method == "GET" and r.path.endswith(kept[0].stem)]
    starts = [int(r.range[len("bytes="):].split("-")[0]) for r in transfers]  # every request asks for a range
    assert [r.status for r in transfers] == [206, 206] and starts[0] == kept_bytes < starts[1] <= size * 4 // 5
    assert transfers[1].sent == size - starts[1]
    snapshot = tmp_path / "hf" / "hub" / "models--org--phi4mm" / "snapshots" / hub.main
    assert filecmp.cmp(snapshot / big, tiny_checkpoint / big, shallow=False)


def test_missing_repository(in_process) -> None:
    one_line_error(in_process("-m", "org/nothing-here", *BUILD), "no such model", "org/nothing-here", "HF_TOKEN")


@pytest.mark.parametrize("token", [None, "hf_notgranted"])
def test_gated_repository_says_how_to_log_in(hub: LocalHub, in_process, token: str | None) -> None:
    hub.clear_log()
    result = in_process("-m", "org/gated", *BUILD, token=token)
    one_line_error(result, "org/gated", "gated", "hf auth login", "HF_TOKEN")
    refused = [r for r in hub.log if r.status in (401, 403)]
    assert refused and refused[0].status == (403 if token else 401) and refused[0].authorized == bool(token)
    assert hub.downloads() == []


def test_server_error_is_retried_then_one_line(hub: LocalHub, in_process, tmp_path: Path) -> None:
    hub.clear_log()
    hub.fail("org/down", 500)
    try:
        result = in_process("-m", "org/down", "-o", str(tmp_path / "out"), *BUILD)
    finally:
        hub.clear_faults()
    one_line_error(result, "org/down", "500", "3 tries")
    assert len([r for r in hub.log if r.path.startswith("/api/models/org/down")]) == 3
    assert not (tmp_path / "out").exists()


def test_not_phi4mm_is_refused_before_any_weight(hub: LocalHub, in_process) -> None:
    hub.clear_log()
    result = in_process("-m", "org/llama", *BUILD)
    one_line_error(result, "org/llama", "not a Phi-4-multimodal checkpoint", "llama")
    assert hub.downloads() == ["config.json"]


@pytest.mark.parametrize("pin", ["v1", "commit"])
def test_revision_pins_a_tag_or_commit_and_the_manifest_traces_it(hub: LocalHub, tmp_path: Path, in_process,
                                                                  tiny_checkpoint: Path, pin: str) -> None:
    revision = hub.v1 if pin == "commit" else "v1"
    args = ("-m", REPO, "--revision", revision, "-o", str(tmp_path / "out"), *BUILD)
    result = in_process(*args) if pin == "commit" else run(hub, tmp_path / "hf", *args)
    assert result.returncode == 0, result.stderr
    package = tmp_path / "out"
    # v1's generation_config.json, not main's later one
    assert filecmp.cmp(package / "generation_config.json", tiny_checkpoint / "generation_config.json", shallow=False)
    data = manifest(package)
    assert data["source"] == {"repository": REPO, "revision": revision, "commit": hub.v1, "endpoint": hub.endpoint}
    assert data["builder"]["name"] == "builder_plugin" and data["builder"]["version"]
    assert data["builder"]["options"]["precision"] == "fp32"
    assert data["builder"]["options"]["components"] == ["embedding"]


def test_local_folder_provenance_and_old_manifests_still_read(tiny_checkpoint: Path, tmp_path: Path,
                                                             tiny_package: Path) -> None:
    from builder_plugin.runtime.manifest import MANIFEST_FILE, Manifest

    data = manifest(tiny_package)
    assert data["source"] == {"local_folder": str(tiny_checkpoint.resolve())}
    assert data["builder"]["options"]["lora"] == "routed"
    old = tmp_path / "old"
    old.mkdir()
    (old / MANIFEST_FILE).write_text(json.dumps({k: data[k] for k in ("format", "routing", "decoders")}))
    assert Manifest.read(old, "x.onnx").decoders == Manifest.read(tiny_package, "x.onnx").decoders


def test_too_little_disk_space_is_refused_before_downloading(hub: LocalHub, tmp_path: Path, monkeypatch, in_process,
                                                            tiny_checkpoint: Path) -> None:
    free = 50_000_000
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - free, free))
    hub.clear_log()
    result = in_process("-m", REPO, "-o", str(tmp_path / "out"), *BUILD)
    err = one_line_error(result, "not enough disk space", "package")
    weights = sum((tiny_checkpoint / n).stat().st_size for n in shards(tiny_checkpoint))
    from builder_plugin.units import human

    assert human(weights) in err and human(free) in err
    assert not set(hub.downloads()) & shards(tiny_checkpoint)
    assert not list((tmp_path / "cache").rglob("*.safetensors")) and not (tmp_path / "out").exists()


def test_dry_run_against_the_hub_prints_the_plan_and_downloads_no_weight(hub: LocalHub, tmp_path: Path, in_process,
                                                                         tiny_checkpoint: Path) -> None:
    from builder_plugin.units import human

    hub.clear_log()
    cache = tmp_path / "cache"  # in_process's -c
    before = sorted(p.relative_to(cache) for p in cache.rglob("*")) if cache.exists() else []
    result = in_process("-m", REPO, "-o", str(tmp_path / "out"), "--dry-run", "--lora", "split")
    assert result.returncode == 0, result.stderr
    after = sorted(p.relative_to(cache) for p in cache.rglob("*")) if cache.exists() else []
    assert after == before  # the dry run's metadata went to a temporary cache of its own
    for name in shards(tiny_checkpoint):
        assert f"{name}  {human((tiny_checkpoint / name).stat().st_size)}" in result.stdout
    assert "vision, speech, embedding, decoder" in result.stdout and "one decoder file per input mode" in result.stdout
    assert "int4" in result.stdout and "expected package size: about" in result.stdout and hub.main in result.stdout
    tokenizer = human((tiny_checkpoint / "tokenizer.json").stat().st_size)
    assert f"tokenizer.json  {tokenizer}  (download)" in result.stdout
    assert set(hub.downloads()) == {"config.json", "model.safetensors.index.json"}  # what tells what a build would be
    assert not (tmp_path / "out").exists()


def test_dry_run_of_a_local_folder_writes_nothing(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    from builder_plugin import cli

    code = cli.main(["-i", str(tiny_checkpoint), "-o", str(tmp_path / "out"), "--dry-run", "-p", "int8"])
    out = capsys.readouterr().out
    assert code == 0 and "local folder" in out and "nothing to download" in out and "int8" in out
    assert list(tmp_path.iterdir()) == []


def test_native_layout_downloads_its_adapter_folders(hub: LocalHub, in_process, tmp_path: Path,
                                                    tiny_native_checkpoint: Path) -> None:
    decoys = {k: v for k, v in DECOYS.items() if not k.endswith("-lora/") and "-lora/" not in k}
    sha = hub.add_commit("org/native", _publish(tmp_path / "repo", tiny_native_checkpoint, decoys))
    hub.clear_log()
    result = in_process("-m", "org/native", "-o", str(tmp_path / "out"), *BUILD)
    assert result.returncode == 0, result.stderr
    adapters = {p.relative_to(tiny_native_checkpoint).as_posix() for p in tiny_native_checkpoint.glob("*-lora/*")}
    assert adapters == {f"{d}/{f}" for d in ("vision-lora", "speech-lora")
                        for f in ("adapter_config.json", "adapter_model.safetensors")}
    assert set(hub.downloads()) == NEEDED | shards(tiny_native_checkpoint) | adapters
    assert manifest(tmp_path / "out")["source"]["commit"] == sha


# --- every file checked against the hub's digest: garbled bytes are downloaded again or refused, never built ----------
# The references are the checkpoint's own files and their digests, computed here with hashlib; the hub fixture garbles
# one byte of a transfer (the size stays right), a test garbles a file in the cache.

def _biggest_shard(checkpoint: Path) -> tuple[str, int]:
    name = max(shards(checkpoint), key=lambda n: (checkpoint / n).stat().st_size)
    return name, (checkpoint / name).stat().st_size


def _warnings(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("warning: ")]


def _one_warning(result: subprocess.CompletedProcess, *needles: str) -> str:
    """A build that succeeded, saying what it repaired in one warning line."""
    assert result.returncode == 0, result.stderr
    [warning] = _warnings(result)
    for needle in needles:
        assert needle in warning, warning
    return warning


def _build_with_faults(hub: LocalHub, in_process, out: Path) -> subprocess.CompletedProcess:
    """The cheapest build, with the faults set on the hub before it; they are cleared after it, whatever happens."""
    try:
        return in_process("-m", REPO, "-o", str(out), *BUILD)
    finally:
        hub.clear_faults()


def _transfers(hub: LocalHub, checkpoint: Path, name: str) -> list[tuple[int, int]]:
    """(first byte, bytes sent) of each GET of `name`'s bytes (from its storage URL, or its resolve URL)."""
    sha = hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()
    starts = []
    for r in hub.log:
        if r.method == "GET" and r.sent and (r.path.endswith(sha) or r.path.endswith(f"/{name}")):
            starts.append((int(r.range[len("bytes="):].split("-")[0]) if r.range else 0, r.sent))
    return starts


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _storage(cache: Path) -> Path:
    return cache / "models--org--phi4mm"


@pytest.mark.parametrize("where", ["whole download", "resumed in the same run"])
def test_a_shard_garbled_in_transfer_is_downloaded_again(hub: LocalHub, in_process, tmp_path: Path,
                                                         tiny_checkpoint: Path, where: str) -> None:
    big, size = _biggest_shard(tiny_checkpoint)
    hub.clear_log()
    if where == "resumed in the same run":
        hub.cut(REPO, big, at_byte=size // 2, times=1)  # http_get resumes at once; the garbled byte is in that part
    hub.corrupt(REPO, big, at_byte=size * 3 // 4, times=1)
    result = _build_with_faults(hub, in_process, tmp_path / "out")
    _one_warning(result, big, "sha256", "downloaded again")
    transfers = _transfers(hub, tiny_checkpoint, big)
    if where == "whole download":
        assert transfers == [(0, size), (0, size)]
    else:  # cut, resumed from the last whole chunk it wrote, then once more whole
        resumed_at = transfers[1][0]
        assert transfers == [(0, size // 2), (resumed_at, size - resumed_at), (0, size)] and resumed_at > 0
    assert filecmp.cmp(_storage(tmp_path / "cache") / "snapshots" / hub.main / big, tiny_checkpoint / big,
                       shallow=False)
    assert (tmp_path / "out" / MANIFEST_FILE).is_file()


@pytest.mark.parametrize("where", ["whole download", "resumed in the same run"])
def test_a_shard_that_always_arrives_garbled_is_refused_and_nothing_is_built(hub: LocalHub, in_process,
                                                                             tmp_path: Path, tiny_checkpoint: Path,
                                                                             where: str) -> None:
    big, size = _biggest_shard(tiny_checkpoint)
    hub.clear_log()
    if where == "resumed in the same run":
        hub.cut(REPO, big, at_byte=size // 2, times=1)
    hub.corrupt(REPO, big, at_byte=size * 3 // 4, times=None)
    result = _build_with_faults(hub, in_process, tmp_path / "out")
    sha = hashlib.sha256((tiny_checkpoint / big).read_bytes()).hexdigest()
    one_line_error(result, big, REPO, f"sha256 {sha[:12]}", "2 downloads", "nothing was built")
    assert len(_transfers(hub, tiny_checkpoint, big)) == (3 if where != "whole download" else 2)
    assert not (tmp_path / "out").exists()
    storage = _storage(tmp_path / "cache")
    assert not list((storage / "blobs").glob(f"{sha}*")) and not (storage / "snapshots" / hub.main / big).exists()


@pytest.mark.parametrize("garbled", ["in the bytes kept", "in the resumed bytes"])
def test_a_resume_by_a_later_run_that_does_not_match_is_downloaded_afresh(hub: LocalHub, in_process, tmp_path: Path,
                                                                          tiny_checkpoint: Path, garbled: str) -> None:
    big, size = _biggest_shard(tiny_checkpoint)
    data = (tiny_checkpoint / big).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    kept = _storage(tmp_path / "cache") / "blobs" / f"{sha}.incomplete"  # what a broken run leaves (tested above)
    kept.parent.mkdir(parents=True)
    kept.write_bytes(data[:size // 2])
    if garbled == "in the bytes kept":
        _flip(kept, size // 4)
    else:
        hub.corrupt(REPO, big, at_byte=size * 3 // 4, times=1)
    hub.clear_log()
    result = _build_with_faults(hub, in_process, tmp_path / "out")
    _one_warning(result, big, "resumed download", "downloaded again")
    assert _transfers(hub, tiny_checkpoint, big) == [(size // 2, size - size // 2), (0, size)]
    assert filecmp.cmp(_storage(tmp_path / "cache") / "snapshots" / hub.main / big, tiny_checkpoint / big,
                       shallow=False)
    assert not kept.exists()


@pytest.mark.parametrize("times", [1, None])
def test_a_small_file_garbled_in_transfer_is_checked_against_its_git_blob_id(hub: LocalHub, in_process,
                                                                             tmp_path: Path, tiny_checkpoint: Path,
                                                                             times: int | None) -> None:
    name = "tokenizer.json"  # kept in git, not LFS: its digest is its git blob id
    data = (tiny_checkpoint / name).read_bytes()
    blob_id = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    hub.clear_log()
    hub.corrupt(REPO, name, at_byte=len(data) // 2, times=times)
    result = _build_with_faults(hub, in_process, tmp_path / "out")
    if times is None:
        one_line_error(result, name, f"git blob sha1 {blob_id[:12]}", "2 downloads")
        assert not (tmp_path / "out").exists()
        assert not list((_storage(tmp_path / "cache") / "blobs").glob(f"{blob_id}*"))
        return
    _one_warning(result, name, "git blob sha1", "downloaded again")
    assert filecmp.cmp(_storage(tmp_path / "cache") / "snapshots" / hub.main / name, tiny_checkpoint / name,
                       shallow=False)
    assert filecmp.cmp(tmp_path / "out" / name, tiny_checkpoint / name, shallow=False)


@pytest.mark.parametrize("kind", ["shard", "tokenizer.json"])
def test_a_file_damaged_in_the_cache_is_downloaded_again_and_refused_offline(hub: LocalHub, in_process,
                                                                            monkeypatch, tmp_path: Path,
                                                                            tiny_checkpoint: Path, kind: str) -> None:
    name = _biggest_shard(tiny_checkpoint)[0] if kind == "shard" else kind
    entry = _storage(tmp_path / "cache") / "snapshots" / hub.main / name
    first = in_process("-m", REPO, "-o", str(tmp_path / "first"), *BUILD)
    assert first.returncode == 0 and _warnings(first) == [], first.stderr
    blob = entry.resolve()
    _flip(blob, blob.stat().st_size // 2)  # bit rot, or a tool that wrote into the cache
    hub.clear_log()
    again = in_process("-m", REPO, "-o", str(tmp_path / "again"), *BUILD)
    _one_warning(again, name, "does not match", "downloading it again")
    assert hub.downloads() == [name]
    assert filecmp.cmp(entry, tiny_checkpoint / name, shallow=False)

    _flip(entry.resolve(), 7)
    hub.clear_log()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = in_process("-m", REPO, "-o", str(tmp_path / "offline"), *BUILD)
    one_line_error(offline, name, "does not match", "run once online")
    assert hub.log == [] and not (tmp_path / "offline").exists()
    assert not entry.exists() and not blob.exists()  # removed: the next online run fetches it


def test_dry_run_reads_a_fresh_copy_of_a_damaged_cached_file_and_leaves_the_cache_as_it_was(
        hub: LocalHub, in_process, tmp_path: Path) -> None:
    first = in_process("-m", REPO, "-o", str(tmp_path / "first"), *BUILD)
    assert first.returncode == 0, first.stderr
    cache = tmp_path / "cache"
    _flip((_storage(cache) / "snapshots" / hub.main / "config.json").resolve(), 0)  # no longer JSON
    before = {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()}
    result = in_process("-m", REPO, "-o", str(tmp_path / "out"), "--dry-run")
    _one_warning(result, "config.json", "git blob sha1", "a build would download it again")
    assert hub.main in result.stdout
    assert {p: p.read_bytes() for p in cache.rglob("*") if p.is_file()} == before
