"""``run.init_from = "s3://..."`` (docs/multi-host.md): a weights file, a Hugging Face folder
and a run folder in an object store load as their local copies do, through the same readers,
against moto's S3 server (the fixture of ``tests/test_s3_run_dir.py``); what is wrong with one is
a line before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain.checkpoint.write import Checkpointer
from dtrain.errors import UserError
from dtrain.weights.init_from import check_init_from, load_weights, read_weights
from tests.test_s3_run_dir import BUCKET, Store, s3fs
from tests.test_s3_run_dir import store as store  # the module-scoped fixture

save_file = pytest.importorskip("safetensors.torch").save_file


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _upload(store: Store, local: Path, key: str) -> str:
    store.fs.put(str(local), f"{BUCKET}/{key}", recursive=local.is_dir())
    return f"s3://{BUCKET}/{key}"


@pytest.fixture
def env(store: Store, monkeypatch: pytest.MonkeyPatch) -> Store:
    """The launch's environment in this process: dtrain's own client finds the store."""
    for name, value in store.env.items():
        monkeypatch.setenv(name, value)
    return store


def test_weights_file_hf_folder_and_run_folder_in_the_store_load_as_local(
    env: Store, tmp_path: Path
) -> None:
    trained = _model(1).state_dict()
    # A weights file of each kind, a Hugging Face folder, a run folder with two checkpoints.
    save_file(trained, str(tmp_path / "w.safetensors"))
    torch.save(trained, tmp_path / "w.pt")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    save_file(trained, str(hf / "model.safetensors"))
    run = tmp_path / "run"
    saver = Checkpointer(
        run / "checkpoints", rank=0, world_size=1, keep_last=5, keep_every=0, log=print
    )
    older = _model(2).state_dict()
    for step, state in ((1, older), (2, trained)):
        saver.save(step, {"model.pt": state}, {"step": step}, blocking=True)
    urls = {
        "file": _upload(env, tmp_path / "w.safetensors", "init/w.safetensors"),
        "torch": _upload(env, tmp_path / "w.pt", "init/w.pt"),
        "hf": _upload(env, hf, "init/hf"),
        "run": _upload(env, run, "init/run"),
    }
    urls["step"] = urls["run"] + "/checkpoints/step-00000001"
    for kind, url in urls.items():
        check_init_from(url)  # what the launcher checks
        loaded = read_weights(url)
        local = read_weights(str(run / "checkpoints/step-00000001")) if kind == "step" else None
        want = local if local is not None else trained
        assert loaded.keys() == want.keys(), kind
        for name in want:
            assert torch.equal(loaded[name], want[name]), (kind, name)
    model = load_weights(_model(3), urls["run"])  # the newest step, as from a local run folder
    assert torch.equal(model.state_dict()["2.weight"], trained["2.weight"])


def test_what_is_wrong_with_a_store_s_init_from_is_one_line(
    env: Store, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = f"s3://{BUCKET}/init-nothing/w.safetensors"
    with pytest.raises(UserError, match=rf"run.init_from = '{missing}': .* does not exist"):
        check_init_from(missing)
    # A damaged checkpoint in the store: refused before any worker starts, as a local one is.
    run = tmp_path / "run"
    saver = Checkpointer(run, rank=0, world_size=1, keep_last=5, keep_every=0, log=print)
    saver.save(1, {"model.pt": _model(1).state_dict()}, {"step": 1}, blocking=True)
    url = _upload(env, run, "init-bad/checkpoints")
    data = bytearray(env.fs.cat_file(f"{BUCKET}/init-bad/checkpoints/step-00000001/model.pt"))
    data[len(data) // 2] ^= 0xFF
    env.fs.pipe_file(f"{BUCKET}/init-bad/checkpoints/step-00000001/model.pt", bytes(data))
    with pytest.raises(UserError, match=r"step-00000001/model\.pt fails its SHA-256"):
        check_init_from(url + "/step-00000001")
    # No credentials anywhere botocore looks: said, with what to set.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()  # dtrain's client is made anew, without them
    try:
        with pytest.raises(UserError) as caught:
            check_init_from(f"s3://{BUCKET}/init/w.safetensors")
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    said = str(caught.value)
    assert said.startswith(f"run.init_from = 's3://{BUCKET}/init/w.safetensors': no credentials")
    assert "AWS_ACCESS_KEY_ID" in said and "\n" not in said
