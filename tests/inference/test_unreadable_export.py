"""An export this user cannot read (``chmod 000`` on a file or on the folder) is refused by medusa-eval,
medusa-tune-tree and medusa-generate with one error naming the path and "no read permission", before any model
loads and before anything is written; and the heads' files are the ones the export's own type uses (a Medusa export
is never asked for ``hydra_heads.safetensors``).

Tests run as root here, where ``chmod`` does not stop reads: the in-process tests make the opener honour the
permission bits as it does for any other user; the command-line test drops root's capability to ignore them
(``setpriv``), so the real commands meet the real ``EACCES``."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from medusa_train.export import save_export
from medusa_train.export.reader import heads_checksum, heads_files
from medusa_train.models.speculative import new_heads_for
from inference.conf import CONF_DIR
from medusa_train.files.paths import REPO_ROOT
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

NO_READ = "has no read permission for this user"


@pytest.fixture
def export(tmp_path) -> Path:
    """A Medusa export of 2 heads for a tiny Llama (the base is never loaded here)."""
    return save_export(new_heads_for(make_tiny_model("llama"), num_heads=2), tmp_path / "export", "org/tiny",
                       vllm=False)


@pytest.fixture
def permission_bits(monkeypatch):
    """``os.open`` and ``os.scandir`` refuse what the mode bits refuse to a user other than the owner's, as they do
    for every user but root (no read bit: EACCES)."""
    real_open, real_scandir = os.open, os.scandir

    def unreadable(path) -> bool:
        try:
            return not os.stat(path).st_mode & (stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        except OSError:
            return False

    def checked_open(path, flags, *args, **kwargs):
        if unreadable(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, flags, *args, **kwargs)

    def checked_scandir(path="."):
        if unreadable(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "open", checked_open)
    monkeypatch.setattr(os, "scandir", checked_scandir)


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model, or reading the heads, fails the test."""
    import inference.cli.generate as generate
    import inference.evaluation.eval_run as eval_run
    import medusa_train.loading.runtime as runtime

    for module in (eval_run, generate, runtime):
        monkeypatch.setattr(module, "load_for_inference", lambda *a, **k: pytest.fail("loaded a model"))
    monkeypatch.setattr(eval_run, "heads_checksum", lambda *a, **k: pytest.fail("read the export"))


def run_command(command: str, export: Path, out: Path):
    """The command's ``run`` on its composed config (what its ``main`` runs after Hydra's callbacks)."""
    if command == "medusa-eval":
        from inference.cli.evaluate import register_schemas, run
        name, overrides = "evaluate", [f"output_dir={out}", "decoders=[vanilla,medusa]"]
    elif command == "medusa-tune-tree":
        from inference.cli.tune_tree import register_schemas, run
        name, overrides = "tune_tree", []
    else:
        from inference.cli.generate import register_schemas, run
        name, overrides = "generate", ["prompt=hi"]
    register_schemas()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose(name, overrides=[f"export_dir={export}", *overrides])
    return run(cfg)


COMMANDS = ["medusa-eval", "medusa-generate", "medusa-tune-tree"]


@pytest.mark.parametrize("unreadable", ["file", "folder", "base_file"])
@pytest.mark.parametrize("command", COMMANDS)
def test_an_unreadable_export_is_refused_naming_the_path_before_any_model_loads(export, tmp_path, permission_bits,
                                                                                no_model, command, unreadable):
    if unreadable == "base_file":  # a Medusa-2 export's fine-tuned base, inside the export
        (export / "base").mkdir()
        (export / "base" / "model.safetensors").write_bytes(b"weights")
    path = {"file": export / "medusa_lm_head.safetensors", "folder": export,
            "base_file": export / "base" / "model.safetensors"}[unreadable]
    what = "a folder that cannot be listed" if unreadable == "folder" else "it cannot be opened"
    before = sorted(os.listdir(export))
    path.chmod(0)
    try:
        with pytest.raises(PermissionError, match=rf"^export_dir={export}: {path} {NO_READ} \({what}\); an export "
                                                  rf"is read whole: give this user read access \(e\.g\. chmod -R "
                                                  rf"a\+rX {export}\), or run as the user who wrote it$") as e:
            run_command(command, export, tmp_path / "eval")
        assert e.value.errno == errno.EACCES
    finally:
        path.chmod(0o755)
    assert sorted(os.listdir(export)) == before  # no lock, no .tune_tree/
    assert not (tmp_path / "eval").exists()


def test_the_check_passes_a_readable_export_and_skips_what_a_write_in_progress_holds(export, permission_bits):
    from medusa_train.export.files import check_readable

    (export / ".config.json.tmp-123").write_text("{}")  # a write in progress: safetensors creates its file 0o600
    (export / ".config.json.tmp-123").chmod(0)
    check_readable(export)
    check_readable(export.parent / "missing")  # the readers name a missing export themselves
    check_readable(None)


def test_a_medusa_exports_heads_are_its_own_files_never_another_types(export, monkeypatch):
    """heads_files reads the type from config.json: a Medusa export is never asked for hydra_heads.safetensors
    (which medusa-eval named when it probed every type's file in a folder it could not enter), and a stray file of
    another type beside the heads does not become the heads' checksum."""
    probed: list[str] = []
    real_is_file = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda self: probed.append(self.name) or real_is_file(self))
    assert heads_files(export) == [export / "medusa_lm_head.safetensors"]
    assert not {"hydra_heads.safetensors", "eagle3_drafter.safetensors"} & set(probed)
    checksum = heads_checksum(export)
    shutil.copy(export / "medusa_lm_head.safetensors", export / "hydra_heads.safetensors")
    assert heads_checksum(export) == checksum
    (export / "medusa_lm_head.safetensors").unlink()
    (export / "medusa_lm_head.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"no medusa_lm_head\.safetensors or medusa_lm_head\.pt in "):
        heads_files(export)


def test_a_hydra_export_without_its_weights_names_its_own_file(tmp_path):
    from medusa_train.models.catalog import new_spec

    base = make_tiny_model("llama")
    heads = new_spec("hydra", {}, base.config, num_heads=2, num_layers=1, hidden_size=32, vocab_size=base.vocab_size)
    from medusa_train.models.catalog import heads_from_spec

    out = save_export(heads_from_spec(heads), tmp_path / "hydra", "org/tiny", vllm=False)
    assert heads_files(out) == [out / "hydra_heads.safetensors"]
    (out / "hydra_heads.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=rf"^{out}/hydra_heads\.safetensors not found: {out}/config\.json "
                                                r"says head_type 'hydra'$"):
        heads_files(out)


def _without_root_privilege(folder: Path) -> list[str] | None:
    """A command prefix under which ``chmod`` stops this process's reads: none needed for a user other than root;
    for root, ``setpriv`` dropping the capabilities that ignore permission bits; None where neither works (a file of
    mode 000 in ``folder`` is the probe)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    prefix = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]
    probe = folder / "probe"
    probe.write_text("")
    probe.chmod(0)
    run = subprocess.run([*prefix, sys.executable, "-c", f"open({str(probe)!r}).close()"], capture_output=True)
    probe.unlink()
    return prefix if run.returncode != 0 else None


MODULES = {"medusa-eval": "inference.cli.evaluate", "medusa-tune-tree": "inference.cli.tune_tree",
           "medusa-generate": "inference.cli.generate"}


@pytest.mark.slow  # four processes: about 60 s on 2 shared cores
def test_the_commands_refuse_a_chmod_000_export_in_one_line_with_exit_2_and_write_nothing(export, tmp_path):
    """The real commands (their Hydra callbacks) as a user chmod stops: a file of the export (each command) and the
    folder itself (medusa-eval; the in-process test above covers every pair)."""
    prefix = _without_root_privilege(tmp_path)
    if prefix is None:
        pytest.skip("running as root without setpriv's capability dropping: chmod does not stop root's reads")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for path, what, commands in [(export / "medusa_lm_head.safetensors", "it cannot be opened", MODULES),
                                 (export, "a folder that cannot be listed", ["medusa-eval"])]:
        path.chmod(0)
        try:
            for command in commands:
                module = MODULES[command]
                extra = {"medusa-eval": [f"output_dir={tmp_path / 'eval'}"], "medusa-generate": ["prompt=hi"]}
                run = subprocess.run([*prefix, sys.executable, "-m", module, f"export_dir={export}",
                                      *extra.get(command, [])], cwd=cwd, capture_output=True, text=True, timeout=300,
                                     env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"})
                assert run.returncode == 2, run.stderr[-3000:]
                assert run.stderr == f"{command}: export_dir={export}: {path} {NO_READ} ({what}); an export is read " \
                                     f"whole: give this user read access (e.g. chmod -R a+rX {export}), or run as " \
                                     "the user who wrote it\n"
        finally:
            path.chmod(0o755)
        assert sorted(os.listdir(export)) == ["config.json", "medusa_lm_head.pt", "medusa_lm_head.safetensors"]
        assert list(cwd.iterdir()) == [] and not (tmp_path / "eval").exists()
