"""sao_core.storage against local paths and real S3 servers on 127.0.0.1 (moto and SeaweedFS)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from s3_servers import free_port

from sao_core import storage
from sao_core.storage import CheckpointError, S3Settings, StorageError

MiB = 2**20


def make_tree(root: Path) -> dict[str, bytes]:
    """A small checkpoint-like directory with nested files; returns {relpath: content}."""
    files = {
        "config.json": b'{"hidden": 8}',
        "model.safetensors": os.urandom(4096),
        "tokenizer/vocab.txt": "ä b c\n".encode(),
        "tokenizer/deep/merges.txt": b"a b\n",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


@pytest.fixture(params=["local", "s3"])
def base(request, tmp_path) -> str:
    """A destination root: a local directory or a fresh moto bucket prefix."""
    if request.param == "local":
        return str(tmp_path / "dest")
    return request.getfixturevalue("moto_s3").uri("root")


# -------------------------------------------------------------------------------------------- URIs


def test_uri_helpers():
    assert storage.is_s3_uri("s3://b/k") and not storage.is_s3_uri("/tmp/x")
    assert storage.parse_s3_uri("s3://my-bucket.v2/a/b.txt") == ("my-bucket.v2", "a/b.txt")
    assert storage.parse_s3_uri("s3://bkt") == ("bkt", "")
    assert storage.join("s3://bkt", "a", "/b/", "c.txt") == "s3://bkt/a/b/c.txt"
    assert storage.join("s3://bkt/pre/", "x") == "s3://bkt/pre/x"
    assert storage.join("/tmp/d/", "sub/f") == "/tmp/d/sub/f"
    assert storage.join("file:///tmp/d", "f") == "file:///tmp/d/f"
    assert storage.join("rel", "") == "rel"


@pytest.mark.parametrize("uri, message", [
    ("s3://", "no bucket"),
    ("s3:///key", "no bucket"),
    ("s3://ab/k", "invalid S3 bucket name"),
    ("s3://Upper/k", "invalid S3 bucket name"),
    ("s3://-dash/k", "invalid S3 bucket name"),
    ("s3://a..b/k", "invalid S3 bucket name"),
    ("s3://10.0.0.1/k", "invalid S3 bucket name"),
    ("gs://bkt/k", "unsupported URI scheme"),
    ("file://host/x", "remote host"),
])
def test_bad_uris(uri, message):
    with pytest.raises(StorageError, match=message):
        storage.read_bytes(uri)


def test_parse_rejects_non_s3():
    with pytest.raises(StorageError, match="not an S3 URI"):
        storage.parse_s3_uri("/local/path")


# ------------------------------------------------------------------------------------ round trips


def test_local_round_trip(tmp_path):
    uri = f"file://{tmp_path}/a/b.bin"
    storage.write_bytes(uri, b"\x00\x01")
    assert storage.read_bytes(str(tmp_path / "a" / "b.bin")) == b"\x00\x01"
    storage.write_text(str(tmp_path / "t.txt"), "héllo")
    assert storage.read_text(str(tmp_path / "t.txt")) == "héllo"
    assert storage.exists(str(tmp_path / "a")) and not storage.exists(str(tmp_path / "nope"))
    assert storage.list_files(str(tmp_path)) == ["a/b.bin", "t.txt"]
    assert storage.list_files(str(tmp_path / "missing")) == []
    assert not [p for p in tmp_path.rglob("*.tmp")], "atomic writes leave no temp files"
    with pytest.raises(StorageError, match="not found: .*nope"):
        storage.read_bytes(str(tmp_path / "nope"))
    with pytest.raises(StorageError, match="not UTF-8"):
        storage.write_bytes(str(tmp_path / "bin"), b"\xff\xfe")
        storage.read_text(str(tmp_path / "bin"))


def test_dir_round_trip(base, tmp_path):
    files = make_tree(tmp_path / "src")
    assert storage.upload_dir(tmp_path / "src", base) == sorted(files)
    assert storage.list_files(base) == sorted(files)
    assert storage.exists(storage.join(base, "tokenizer")), "a directory/prefix exists"
    assert storage.exists(storage.join(base, "config.json"))
    assert not storage.exists(storage.join(base, "absent.json"))
    assert storage.download_dir(base, tmp_path / "back") == sorted(files)
    for rel, data in files.items():
        assert (tmp_path / "back" / rel).read_bytes() == data
        assert storage.read_bytes(storage.join(base, rel)) == data
    storage.write_text(storage.join(base, "note.txt"), "ünïcode")
    assert storage.read_text(storage.join(base, "note.txt")) == "ünïcode"
    storage.download_file(storage.join(base, "note.txt"), tmp_path / "x" / "note.txt")
    assert (tmp_path / "x" / "note.txt").read_text() == "ünïcode"
    storage.upload_file(tmp_path / "x" / "note.txt", storage.join(base, "copy/note.txt"))
    assert storage.read_text(storage.join(base, "copy/note.txt")) == "ünïcode"
    with pytest.raises(StorageError, match="not found: .*empty-prefix"):
        storage.download_dir(storage.join(base, "empty-prefix"), tmp_path / "none")


def test_s3_not_found_messages(moto_s3, tmp_path):
    missing = moto_s3.uri("no/such/key.txt")
    with pytest.raises(StorageError, match=f"not found: {missing}"):
        storage.read_bytes(missing)
    with pytest.raises(StorageError, match=f"not found: {missing}"):
        storage.download_file(missing, tmp_path / "f")
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-x' does not exist"):
        storage.read_bytes("s3://no-such-bucket-x/k")
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-x' does not exist"):
        storage.download_file("s3://no-such-bucket-x/k", tmp_path / "f")
    (tmp_path / "up").write_bytes(b"1")
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-x' does not exist"):
        storage.upload_file(tmp_path / "up", "s3://no-such-bucket-x/k")
    with pytest.raises(StorageError, match="prefix, not an object"):
        storage.write_bytes(moto_s3.uri("dir/"), b"x")
    with pytest.raises(StorageError, match="not found: local file"):
        storage.upload_file(tmp_path / "absent", moto_s3.uri("k"))
    assert not storage.exists("s3://no-such-bucket-x/k")
    assert storage.exists(moto_s3.uri()) and not storage.exists("s3://no-such-bucket-x")


def test_multipart_upload(moto_s3, tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(12 * MiB))
    settings = S3Settings(multipart_threshold_bytes=5 * MiB, multipart_chunk_bytes=5 * MiB)
    uri = moto_s3.uri("big/big.bin")
    storage.upload_file(big, uri, settings)
    etag = moto_s3.client().head_object(Bucket=moto_s3.bucket, Key="big/big.bin")["ETag"]
    assert etag.strip('"').endswith("-3"), etag  # 5 + 5 + 2 MiB parts
    storage.download_file(uri, tmp_path / "again.bin", settings)
    assert (tmp_path / "again.bin").read_bytes() == big.read_bytes()
    storage.upload_file(tmp_path / "again.bin", moto_s3.uri("big/single.bin"))  # default: one PUT
    etag = moto_s3.client().head_object(Bucket=moto_s3.bucket, Key="big/single.bin")["ETag"]
    assert "-" not in etag


def test_unreachable_endpoint_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    storage._clear_client_cache()
    endpoint = f"http://127.0.0.1:{free_port()}"
    settings = S3Settings(endpoint_url=endpoint)
    (tmp_path / "f").write_bytes(b"1")
    for call in (lambda: storage.read_bytes("s3://bkt/k", settings),
                 lambda: storage.exists("s3://bkt/k", settings),
                 lambda: storage.upload_file(tmp_path / "f", "s3://bkt/k", settings)):
        start = time.monotonic()
        with pytest.raises(StorageError, match=f"endpoint {endpoint} is unreachable"):
            call()
        assert time.monotonic() - start < 15
    storage._clear_client_cache()


# ------------------------------------------------------------------------------------- checkpoints


def test_publish_verify_fetch(base, tmp_path):
    files = make_tree(tmp_path / "ckpt")
    dest = storage.join(base, "step-1")
    manifest = storage.publish_checkpoint(tmp_path / "ckpt", dest, metadata={"step": 1})
    assert manifest["format"] == 1 and manifest["metadata"] == {"step": 1}
    assert set(manifest["files"]) == set(files)
    assert manifest["files"]["config.json"]["size"] == len(files["config.json"])
    assert storage.is_complete_checkpoint(dest)
    assert storage.read_manifest(dest) == manifest
    local = storage.fetch_checkpoint(dest, tmp_path / "cache")
    assert storage.verify_checkpoint(local) == manifest
    for rel, data in files.items():
        assert (local / rel).read_bytes() == data
    if storage.is_s3_uri(dest):
        assert local.parent == tmp_path / "cache"
    else:
        assert local == Path(dest)


def test_republish_and_bookkeeping_files_are_not_in_manifest(base, tmp_path):
    make_tree(tmp_path / "ckpt")
    dest = storage.join(base, "c")
    storage.publish_checkpoint(tmp_path / "ckpt", dest, metadata={"v": 1})
    fetched = storage.fetch_checkpoint(dest, tmp_path / "cache")
    # republishing a fetched copy (which holds manifest.json and _COMPLETE) to the same place
    manifest = storage.publish_checkpoint(fetched, dest, metadata={"v": 2})
    assert storage.MANIFEST_NAME not in manifest["files"] and storage.COMPLETE_MARKER not in manifest["files"]
    assert storage.read_manifest(dest)["metadata"] == {"v": 2}


def test_a_republish_removes_what_an_earlier_or_killed_publish_left(base, tmp_path):
    """A file at the destination that the new checkpoint does not hold (a killed copy's temporary file, another
    shard layout) would be refused by every verified load (issue 17): publishing removes it."""
    make_tree(tmp_path / "ckpt")
    dest = storage.join(base, "v000003")
    storage.write_bytes(storage.join(dest, ".model.safetensors.0123abcd.tmp"), b"half a copy")
    storage.write_bytes(storage.join(dest, "model-00002-of-00002.safetensors"), b"old layout")
    manifest = storage.publish_checkpoint(tmp_path / "ckpt", dest)
    assert set(storage.list_files(dest)) == set(manifest["files"]) | {storage.MANIFEST_NAME, storage.COMPLETE_MARKER}
    assert storage.verify_checkpoint(storage.fetch_checkpoint(dest, tmp_path / "cache")) == manifest


def test_seal_publishes_a_local_directory_in_place(tmp_path):
    files = make_tree(tmp_path / "model")
    manifest = storage.seal_checkpoint(tmp_path / "model", metadata={"kind": "model"})
    assert set(manifest["files"]) == set(files) and storage.is_complete_checkpoint(str(tmp_path / "model"))
    assert storage.verify_checkpoint(tmp_path / "model") == manifest
    (tmp_path / "model" / "notes.txt").write_text("added later")
    with pytest.raises(CheckpointError, match=r"not in its manifest.json: .*/model/notes\.txt"):
        storage.verify_checkpoint(tmp_path / "model")
    assert storage.verify_checkpoint(tmp_path / "model", allow_unlisted=True) == manifest


def test_incomplete_checkpoints_are_ignored(base, tmp_path):
    make_tree(tmp_path / "ckpt")
    assert storage.latest_checkpoint(base) is None
    storage.publish_checkpoint(tmp_path / "ckpt", storage.join(base, "step-1"), metadata={"step": 1})
    storage.publish_checkpoint(tmp_path / "ckpt", storage.join(base, "step-2"), metadata={"step": 2})
    assert storage.latest_checkpoint(base) == storage.join(base, "step-2")
    storage._delete(storage.join(base, "step-2", storage.COMPLETE_MARKER), None)  # publisher "died"
    assert not storage.is_complete_checkpoint(storage.join(base, "step-2"))
    assert storage.latest_checkpoint(base) == storage.join(base, "step-1")
    with pytest.raises(CheckpointError, match="incomplete checkpoint: .*step-2/_COMPLETE"):
        storage.read_manifest(storage.join(base, "step-2"))
    with pytest.raises(CheckpointError, match="incomplete"):
        storage.fetch_checkpoint(storage.join(base, "step-2"), tmp_path / "cache")


def test_delete_checkpoint(base, tmp_path):
    make_tree(tmp_path / "ckpt")
    for name, step in (("step-1", 1), ("step-2", 2), ("step-20", 20)):
        storage.publish_checkpoint(tmp_path / "ckpt", storage.join(base, name), metadata={"step": step})
    storage.delete_checkpoint(storage.join(base, "step-20"))
    assert storage.list_files(storage.join(base, "step-20")) == [] and not storage.exists(storage.join(base, "step-20"))
    assert storage.list_dirs(base) == ["step-1", "step-2"]
    assert storage.latest_checkpoint(base) == storage.join(base, "step-2")
    storage.delete_checkpoint(storage.join(base, "step-2"))  # a name that prefixes no other (step-20 is gone)
    assert storage.list_dirs(base) == ["step-1"] and storage.verify_checkpoint(
        storage.fetch_checkpoint(storage.join(base, "step-1"), tmp_path / "cache"))
    storage.delete_checkpoint(storage.join(base, "step-2"))  # already deleted: not an error
    storage.delete_checkpoint(storage.join(base, "never-published"))
    assert storage.list_dirs(base) == ["step-1"]


def test_delete_checkpoint_keeps_neighbours_with_a_longer_name(base, tmp_path):
    make_tree(tmp_path / "ckpt")
    for name in ("v1", "v10"):
        storage.publish_checkpoint(tmp_path / "ckpt", storage.join(base, name))
    storage.delete_checkpoint(storage.join(base, "v1"))
    assert storage.list_dirs(base) == ["v10"] and storage.is_complete_checkpoint(storage.join(base, "v10"))


def test_a_half_deleted_checkpoint_is_never_complete(base, tmp_path, monkeypatch):
    """The marker goes first: a delete that fails half-way leaves an incomplete checkpoint, which readers
    ignore; deleting again finishes the job."""
    make_tree(tmp_path / "ckpt")
    for step in (1, 2):
        storage.publish_checkpoint(tmp_path / "ckpt", storage.join(base, f"step-{step}"), metadata={"step": step})
    real_delete = storage._delete
    calls = []

    def delete_only_markers(uri, settings):
        calls.append(uri)
        if not uri.endswith(storage.COMPLETE_MARKER):
            raise StorageError(f"injected failure deleting {uri}")
        real_delete(uri, settings)

    def rmtree_fails(path, *args, **kwargs):
        raise OSError(f"injected failure removing {path}")

    monkeypatch.setattr(storage, "_delete", delete_only_markers)
    monkeypatch.setattr(storage.shutil, "rmtree", rmtree_fails)
    with pytest.raises(StorageError, match="injected"):
        storage.delete_checkpoint(storage.join(base, "step-2"))
    monkeypatch.undo()
    half = storage.join(base, "step-2")
    assert calls[0] == storage.join(half, storage.COMPLETE_MARKER)  # before any other file was touched
    assert storage.list_files(half) and not storage.is_complete_checkpoint(half)
    assert storage.latest_checkpoint(base) == storage.join(base, "step-1")
    storage.delete_checkpoint(half)
    assert storage.list_files(half) == [] and storage.list_dirs(base) == ["step-1"]


def test_delete_checkpoint_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(StorageError, match="is a file, not a checkpoint directory"):
        storage.delete_checkpoint(str(tmp_path / "f"))
    assert (tmp_path / "f").exists()


def test_latest_prefers_step_then_time(base, tmp_path):
    make_tree(tmp_path / "ckpt")
    storage.publish_checkpoint(tmp_path / "ckpt", storage.join(base, "b"), metadata={"step": 10})
    storage.publish_checkpoint(tmp_path / "ckpt", storage.join(base, "a"), metadata={"step": 2})
    storage.publish_checkpoint(tmp_path / "ckpt", storage.join(base, "c"))  # no step: ranks below
    assert storage.latest_checkpoint(base) == storage.join(base, "b")
    other = storage.join(base, "nostep")
    storage.publish_checkpoint(tmp_path / "ckpt", storage.join(other, "old"))
    time.sleep(0.01)
    storage.publish_checkpoint(tmp_path / "ckpt", storage.join(other, "new"))
    assert storage.latest_checkpoint(other) == storage.join(other, "new")


def test_local_corruption_names_the_file(tmp_path):
    make_tree(tmp_path / "ckpt")
    dest = tmp_path / "pub"
    storage.publish_checkpoint(tmp_path / "ckpt", str(dest))
    (dest / "tokenizer" / "vocab.txt").write_bytes(b"tampered")
    with pytest.raises(CheckpointError, match=r"corrupt: .*tokenizer/vocab\.txt"):
        storage.verify_checkpoint(dest)
    with pytest.raises(CheckpointError, match=r"tokenizer/vocab\.txt"):
        storage.fetch_checkpoint(str(dest), tmp_path / "cache")
    (dest / "tokenizer" / "vocab.txt").unlink()
    with pytest.raises(CheckpointError, match=r"missing: .*tokenizer/vocab\.txt"):
        storage.verify_checkpoint(dest)
    manifest = json.loads((dest / storage.MANIFEST_NAME).read_text())
    manifest["files"]["../escape"] = {"sha256": "0" * 64, "size": 1}
    (dest / storage.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="unsafe file path '../escape'"):
        storage.read_manifest(str(dest))
    (dest / storage.MANIFEST_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable checkpoint manifest .*manifest.json"):
        storage.read_manifest(str(dest))


def test_s3_corruption_names_the_file(moto_s3, tmp_path):
    make_tree(tmp_path / "ckpt")
    dest = moto_s3.uri("ckpt")
    storage.publish_checkpoint(tmp_path / "ckpt", dest)
    storage.write_bytes(storage.join(dest, "model.safetensors"), b"oops")
    with pytest.raises(CheckpointError, match=f"corrupt: {dest}/model.safetensors"):
        storage.fetch_checkpoint(dest, tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir()), "a failed fetch leaves nothing in the cache"


def test_fetch_reuses_verified_cache(moto_s3, tmp_path):
    make_tree(tmp_path / "ckpt")
    dest = moto_s3.uri("runs/r1/step-5")
    storage.publish_checkpoint(tmp_path / "ckpt", dest, metadata={"step": 5})
    first = storage.fetch_checkpoint(dest, tmp_path / "cache")
    stamps = {p: p.stat().st_mtime_ns for p in first.rglob("*")}
    time.sleep(0.02)
    second = storage.fetch_checkpoint(dest + "/", tmp_path / "cache")
    assert second == first
    assert {p: p.stat().st_mtime_ns for p in second.rglob("*")} == stamps, "nothing re-downloaded"
    # a damaged cached copy is replaced by a fresh download
    (first / "config.json").write_bytes(b"damaged")
    third = storage.fetch_checkpoint(dest, tmp_path / "cache")
    assert (third / "config.json").read_bytes() == (tmp_path / "ckpt" / "config.json").read_bytes()
    # a republished checkpoint (new manifest) is downloaded again
    (tmp_path / "ckpt" / "config.json").write_bytes(b'{"hidden": 16}')
    storage.publish_checkpoint(tmp_path / "ckpt", dest, metadata={"step": 5})
    fourth = storage.fetch_checkpoint(dest, tmp_path / "cache")
    assert (fourth / "config.json").read_bytes() == b'{"hidden": 16}'
    assert json.loads((fourth / storage.MANIFEST_NAME).read_text()) == storage.read_manifest(dest)


def test_unserialisable_metadata_is_refused(tmp_path):
    make_tree(tmp_path / "ckpt")
    with pytest.raises(StorageError, match="not JSON-serialisable"):
        storage.publish_checkpoint(tmp_path / "ckpt", str(tmp_path / "pub"), metadata={"x": object()})
    assert not (tmp_path / "pub").exists()


# ----------------------------------------------------------------------- SeaweedFS (checks credentials)


def test_seaweedfs_round_trip(seaweed_s3, tmp_path):
    uri = seaweed_s3.uri("data/hello.txt")
    storage.write_text(uri, "hello seaweed")
    assert storage.read_text(uri) == "hello seaweed"
    make_tree(tmp_path / "ckpt")
    dest = seaweed_s3.uri("ckpts/step-3")
    storage.publish_checkpoint(tmp_path / "ckpt", dest, metadata={"step": 3})
    assert storage.latest_checkpoint(seaweed_s3.uri("ckpts")) == dest
    local = storage.fetch_checkpoint(dest, tmp_path / "cache")
    assert storage.verify_checkpoint(local)["metadata"] == {"step": 3}


def test_seaweedfs_delete_checkpoint(seaweed_s3, tmp_path):
    files = make_tree(tmp_path / "ckpt")
    for name in ("v1", "v10"):
        storage.publish_checkpoint(tmp_path / "ckpt", seaweed_s3.uri(f"w/{name}"))
    storage.delete_checkpoint(seaweed_s3.uri("w/v1"))
    storage.delete_checkpoint(seaweed_s3.uri("w/v1"))  # already deleted: not an error
    kept = [*files, storage.MANIFEST_NAME, storage.COMPLETE_MARKER]
    assert storage.list_files(seaweed_s3.uri("w")) == sorted(f"v10/{rel}" for rel in kept)


@pytest.mark.parametrize("key_id, secret", [("right", "wrong-secret"), ("nobody", "whatever")])
def test_seaweedfs_wrong_credentials(seaweed_s3, monkeypatch, tmp_path, key_id, secret):
    storage.write_text(seaweed_s3.uri("k.txt"), "x")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed_s3.access_key if key_id == "right" else key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    storage._clear_client_cache()
    (tmp_path / "f").write_bytes(b"1")
    rejected = f"credentials were rejected for bucket '{seaweed_s3.bucket}'"
    for call in (lambda: storage.read_text(seaweed_s3.uri("k.txt")),
                 lambda: storage.write_text(seaweed_s3.uri("k2.txt"), "y"),
                 lambda: storage.exists(seaweed_s3.uri("k.txt")),
                 lambda: storage.list_files(seaweed_s3.uri()),
                 lambda: storage.upload_file(tmp_path / "f", seaweed_s3.uri("k3.txt"))):
        with pytest.raises(StorageError, match=rejected):
            call()


def test_local_storage_works_without_boto3_and_s3_says_what_is_missing(tmp_path):
    """The GPU check kit's environment has no boto3: local checkpoints still publish and verify; an s3:// URI
    fails with one clear StorageError."""
    import subprocess
    import sys

    code = ("import sys\nsys.modules['boto3'] = None\n"
            "from pathlib import Path\nfrom sao_core import storage\n"
            f"src = Path({str(tmp_path / 'src')!r}); src.mkdir(); (src / 'w.bin').write_bytes(b'x')\n"
            f"storage.publish_checkpoint(src, {str(tmp_path / 'pub')!r})\n"
            f"storage.verify_checkpoint({str(tmp_path / 'pub')!r})\n"
            "try:\n    storage.exists('s3://bucket/key')\nexcept storage.StorageError as err:\n    print('ERR', err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "ERR s3:// URIs need boto3, which is not installed: pip install boto3" in done.stdout


# -------------------------------------------------------------------------------------------- checkpoint retention
def test_prune_checkpoints_keeps_the_newest_complete_ones_and_the_pinned(base, tmp_path):
    """Issue 31: keep_checkpoints. Steps 1-5 complete, an incomplete publish at step 2 (a crash cut it short)
    and one at step 6 (being written now): keep 2 with step 1 pinned leaves 1, 4, 5 and the newer incomplete 6;
    the newest complete one is still found by a resume; keep 0 deletes nothing."""
    from sao_core.training.checkpointing import prune_checkpoints

    checkpoints = storage.join(base, "checkpoints")
    src = tmp_path / "src"
    src.mkdir()
    (src / "state.json").write_text("{}")
    for step in (1, 2, 3, 4, 5):
        storage.publish_checkpoint(src, storage.join(checkpoints, f"step-{step:06d}"), metadata={"step": step})
    storage.delete_file(storage.join(checkpoints, "step-000002", "manifest.json"))   # cut short
    storage.begin_checkpoint(storage.join(checkpoints, "step-000006"))
    storage.write_text(storage.join(checkpoints, "step-000006", "state.json"), "{}")
    assert prune_checkpoints(checkpoints, keep=0) == []
    deleted = prune_checkpoints(checkpoints, keep=2, pinned=(1,))
    assert sorted(d.rsplit("/", 1)[-1] for d in deleted) == ["step-000002", "step-000003"]
    assert sorted(storage.list_dirs(checkpoints)) == ["step-000001", "step-000004", "step-000005", "step-000006"]
    assert storage.latest_checkpoint(checkpoints) == storage.join(checkpoints, "step-000005")
    assert prune_checkpoints(storage.join(base, "nothing-here"), keep=2) == []
