"""benchmarks/data_scaling.py: the cells' names and settings, bad cells refused, the table rendered and a finished
cell never run again (the recipe itself is run by the benchmark, not here)."""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def scaling(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("data_scaling", REPO_ROOT / "benchmarks" / "data_scaling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "TABLE", tmp_path / "data-scaling.json")
    monkeypatch.setattr(module, "DOC", tmp_path / "data-scaling.md")
    monkeypatch.setattr(module, "PLOT", tmp_path / "figures" / "data-scaling.png")
    return module


def test_cells_parse_into_settings_and_names(scaling):
    assert scaling.parse_cell("medusa:4") == {"drafter": "medusa", "size": 4, "vocab": None, "ttt": None}
    cell = scaling.parse_cell("eagle3:16:vocab=16384:ttt=7")
    assert (cell["vocab"], cell["ttt"]) == (16384, 7)
    assert scaling.cell_name(cell) == "eagle3-16-vocab16384-ttt7" and scaling.cell_name(scaling.parse_cell("hydra:1")) == "hydra-1"


@pytest.mark.parametrize("text, message", [
    ("medusa", "write DRAFTER:SIZE"), ("lookahead:1", "write DRAFTER:SIZE with DRAFTER one of medusa, hydra, eagle3"),
    ("medusa:0", "'0' is not a positive integer"), ("eagle3:4:vocab=big", "'big' is not a positive integer"),
    ("eagle3:4:depth=3", "unknown setting 'depth'"), ("medusa:4:ttt=5", "ttt= is EAGLE-3's"),
    ("medusa:²", r"'medusa:²': '²' is not a positive integer"),  # str.isdigit admits it, int() does not
    ("medusa:99999999999999999999", r"'medusa:99999999999999999999': size must be in \[1, 22\] \(SIZE x 700 "
                                    r"ShareGPT conversations stay below the held-out prompts at 16,000\), got "
                                    r"99999999999999999999"),
    ("medusa:23", r"size must be in \[1, 22\]"), ("eagle3:4:vocab=99999999", "vocab must be at most 1048576"),
])
def test_a_bad_cell_is_refused_naming_it(scaling, text, message):
    with pytest.raises(ValueError, match=message):
        scaling.parse_cell(text)


def test_the_script_refuses_a_bad_cell_in_one_line_with_exit_2_before_any_run(scaling, monkeypatch, capsys):
    monkeypatch.setattr(scaling, "measure", lambda cell, args: pytest.fail("a cell ran"))
    with pytest.raises(SystemExit) as e:
        scaling.main(["--cells", "medusa:1", "medusa:99999999999999999999"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("data_scaling.py: error: --cells 'medusa:99999999999999999999': size must be in [1, 22]")


def test_the_largest_size_keeps_the_training_data_below_the_held_out_prompts_in_both_scripts(scaling):
    from medusa_train.chat.prompts import SHAREGPT_HELDOUT_OFFSET

    assert scaling.MAX_SIZE == 22 and 22 * 700 < SHAREGPT_HELDOUT_OFFSET <= 23 * 700
    recipe = (REPO_ROOT / "launch" / "recipe_scale.py").read_text()
    assert f"\nMAX_SIZE = {scaling.MAX_SIZE}\n" in recipe


def record(name, drafter, size, tokens, tau):
    bench = {"tau": tau, "speedup": 1.1, "speedup_low": 1.0, "speedup_high": 1.2, "prompts": 16,
             "exact_match_vs_vanilla": 1.0, "dtype": "bfloat16"}
    return {"cell": name, "drafter": drafter, "size": size, "vocab": None, "ttt": None, "labelled_tokens": tokens,
            "epochs": 5, "precision": "bf16", "train_minutes": 4.25, "mt_bench": bench, "spec_bench": bench,
            "vllm_mean_acceptance_length": None, "exact_match_fp32": 1.0,
            "cpu": {"model": "x", "flags": ["amx_bf16", "avx2"], "cores": 2}, "load_average": {"before": 0.5, "after": 1.0}}


def test_the_table_is_rendered_between_its_markers_and_the_text_around_kept(scaling):
    scaling.DOC.write_text(f"# Title\n\nintro\n\n{scaling.BEGIN}\nold\n{scaling.END}\n\nafter\n", encoding="utf-8")
    cells = [record("eagle3-1", "eagle3", 1, 80_000, 1.61), record("medusa-4", "medusa", 4, 320_000, 1.72),
             record("medusa-1", "medusa", 1, 80_000, 1.55)]
    scaling.render(cells)
    text = scaling.DOC.read_text(encoding="utf-8")
    assert text.startswith("# Title\n\nintro\n\n") and text.endswith("\n\nafter\n") and "old" not in text
    rows = [line for line in text.splitlines() if line.startswith("| medusa") or line.startswith("| eagle3")]
    assert [r.split(" | ")[0] for r in rows] == ["| medusa-1", "| medusa-4", "| eagle3-1"]  # by drafter, then size
    assert "| 320,000 | 5 | bf16 | 4.2 | 1.72 | 1.10x [1.00, 1.20] (16) |" in rows[1] and rows[1].endswith("AMX (0.5/1.0) |")
    assert scaling.PLOT.stat().st_size > 1000
    scaling.DOC.write_text("# markers gone\n", encoding="utf-8")
    with pytest.raises(ValueError, match="table markers .* are missing"):
        scaling.render(cells)


def test_a_finished_cell_is_not_run_again(scaling, monkeypatch, capsys):
    scaling.TABLE.write_text(json.dumps([record("medusa-1", "medusa", 1, 80_000, 1.5)]), encoding="utf-8")
    monkeypatch.setattr(scaling, "measure", lambda cell, args: pytest.fail("a finished cell was measured again"))
    assert scaling.main(["--cells", "medusa:1"]) == 0
    assert "medusa-1: in" in capsys.readouterr().out


def test_recipe_scale_refuses_bad_arguments_before_any_work(tmp_path):
    for args, message in [(["medusa"], "usage: bash launch/recipe_scale.sh DRAFTER SIZE"),
                          (["lookahead", "1"], "DRAFTER=lookahead: choose medusa, hydra or eagle3"),
                          (["medusa", "x"], "SIZE=x: give a positive integer"),
                          (["medusa", "23"], "SIZE=23: give at most 22 (22 x 700 = 15400 ShareGPT conversations"),
                          (["medusa", "99999999999999999999"], "SIZE=99999999999999999999: give at most 22")]:
        done = subprocess.run(["bash", str(REPO_ROOT / "launch" / "recipe_scale.sh"), *args], capture_output=True,
                              text=True, env={"PATH": "/usr/bin:/bin", "SCALE_OUT": str(tmp_path / "scale")})
        assert done.returncode == 2 and message in done.stderr, done.stderr
    done = subprocess.run(["bash", str(REPO_ROOT / "launch" / "recipe_scale.sh"), "medusa", "1"], capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "SCALE_TTT_STEPS": "3"})
    assert done.returncode == 2 and "only EAGLE-3 has training-time-test steps" in done.stderr
    assert not (tmp_path / "scale").exists()


def test_the_replies_of_a_size_are_archived_once_and_restored_byte_for_byte(scaling, tmp_path):
    folder, archive = tmp_path / "scale" / "replies-4", tmp_path / "data" / "replies-4.tar.gz"
    with pytest.raises(FileNotFoundError, match="no reply blocks"):
        scaling.archive_replies(folder, archive)
    folder.mkdir(parents=True)
    blocks = {"conversations.block000000.jsonl": b'{"id": "a"}\n{"id": "b"}\n',
              "conversations.block000001.jsonl": b'{"id": "c"}\n'}
    for name, data in blocks.items():
        (folder / name).write_bytes(data)
    assert scaling.archive_replies(folder, archive) is True
    first = archive.read_bytes()
    assert scaling.archive_replies(folder, archive) is False and archive.read_bytes() == first  # never rewritten
    archive.unlink()
    (folder / "conversations.block000000.jsonl").touch()  # a newer time: the same archive, byte for byte
    assert scaling.archive_replies(folder, archive) is True and archive.read_bytes() == first

    # another machine: no folder; then a folder a killed regeneration left (one block cut short, one missing)
    elsewhere = tmp_path / "elsewhere" / "replies-4"
    assert scaling.restore_replies(archive, elsewhere) == 2
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == blocks
    assert scaling.restore_replies(archive, elsewhere) == 0  # equal blocks left alone
    (elsewhere / "conversations.block000000.jsonl").write_bytes(b'{"id": "a"}\n')
    (elsewhere / "conversations.block000001.jsonl").unlink()
    assert scaling.restore_replies(archive, elsewhere) == 2
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == blocks
    assert scaling.restore_replies(tmp_path / "none.tar.gz", tmp_path / "untouched") == 0
    assert not (tmp_path / "untouched").exists()


def test_an_archive_that_is_not_reply_blocks_is_refused_before_anything_is_written(scaling, tmp_path):
    import io
    import tarfile

    archive = tmp_path / "replies-1.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("conversations.block000000.jsonl", "../escape.jsonl"):  # a good block first, then a bad one
            tar.addfile(tarfile.TarInfo(name), io.BytesIO(b""))
    with pytest.raises(ValueError, match="is not a reply block"):
        scaling.restore_replies(archive, tmp_path / "replies-1")
    assert not (tmp_path / "replies-1").exists() and not (tmp_path / "escape.jsonl").exists()
