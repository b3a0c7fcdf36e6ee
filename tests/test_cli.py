"""The ``grpo-patches`` command line as a user meets it: usage per command, close matches on a typo,
``--version``, ``--json`` reports, Hub model ids (config.json only) and plain words (no codes)."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest

from grpo_patches.cli import main as cli_main
from grpo_patches.preflight import preflight
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--set", "per_device_train_batch_size=4", "--set", "num_generations=4", "--set", "max_completion_length=64"]


def test_version_names_the_kit_and_the_installed_trl(capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["--version"])
    assert done.value.code == 0
    from grpo_patches import __version__

    assert re.fullmatch(rf"grpo-patches {re.escape(__version__)} \(TRL [0-9.]+\w* installed\)\n", capsys.readouterr().out)


def test_bare_commands_print_their_usage(capsys):
    assert cli_main([]) == 2
    assert "doctor" in capsys.readouterr().out
    assert cli_main(["doctor"]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith("usage: grpo-patches doctor") and "--model" in captured.out
    assert "give the policy with --model" in captured.err


@pytest.mark.parametrize(("argv", "usage", "hint"), [
    (["doctor", "--model", "qwen2.5-0.5b", "--wrld-size", "2"], "usage: grpo-patches doctor",
     "did you mean --world-size"),
    (["doctor", "--model", "qwen2.5-0.5b", "--sharding", "fsdp3"], "usage: grpo-patches doctor", "did you mean fsdp2"),
    (["docter", "--model", "qwen2.5-0.5b"], "usage: grpo-patches [", "did you mean doctor"),
    (["versions", "--jsn"], "usage: grpo-patches versions", "did you mean --json"),
])
def test_a_typo_gets_the_commands_usage_and_the_close_match(capsys, argv, usage, hint):
    with pytest.raises(SystemExit) as done:
        cli_main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith(usage) and hint in err, err


def test_doctor_json_is_the_report(capsys):
    assert cli_main(["doctor", "--model", "qwen2.5-0.5b", "--world-size", "2", "--gpu-memory-gb", "80", *SMALL,
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    report = preflight("qwen2.5-0.5b", grpo_config={"per_device_train_batch_size": 4, "num_generations": 4,
                                                    "max_completion_length": 64}, world_size=2, gpu_memory_gb=80,
                       warn=False)
    assert data == json.loads(json.dumps(report.to_dict()))
    assert data["ok"] and data["fits"] and [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["ranks"][0]["components"]["weights"] == report.ranks[0].components["weights"] > 0
    assert cli_main(["doctor", "--model", "qwen2.5-0.5b", "--world-size", "2", "--set",
                     "per_device_train_batch_size=2", "--set", "steps_per_generation=1", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert not data["ok"] and "Nearest valid settings" in data["errors"][0]


def test_plan_json_lists_every_combination_the_text_leaves_out(capsys):
    argv = ["doctor", "--model", "llama-3.1-70b", "--world-size", "4", "--gpu-memory-gb", "24", *SMALL, "--plan"]
    cli_main(argv)
    text = capsys.readouterr().out
    cli_main([*argv, "--json"])
    data = json.loads(capsys.readouterr().out)
    assert "Plan.entries" not in text and "--json lists them all" in text  # some are left out of the text
    fit, total = map(int, re.search(r"plan: (\d+) of (\d+) combinations fit", text).groups())
    assert len(data["entries"]) == total
    assert sum(e["fits"] and not e["known_failure"] for e in data["entries"]) == fit
    assert data["best"]["label"] == data["entries"][0]["label"] and data["entries"][0]["report"]["ranks"]


def test_versions_json_has_a_row_per_release(capsys):
    from grpo_patches import compat

    assert cli_main(["versions", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["trl"] for r in rows] == sorted(compat.table()["supported"], key=compat._key)
    assert {r["status"] for r in rows} <= {"patched", "needs-no-patch", "refused"}


def hub_cache(tmp_path: Path, repo: str, config: dict) -> Path:
    """A Hub cache holding only ``repo``'s config.json, as ``huggingface-cli download repo config.json`` leaves it."""
    sha = "0" * 40
    folder = tmp_path / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(sha)
    (folder / "snapshots" / sha).mkdir(parents=True)
    (folder / "snapshots" / sha / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_hub_id_reads_its_config_json_and_nothing_else(capsys, tmp_path, monkeypatch):
    import huggingface_hub

    config = tiny_config().to_dict()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here: the cache stands in for the Hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache(tmp_path / "hub", "owner/tiny", config)))
    asked = []
    real = huggingface_hub.hf_hub_download

    def download(repo_id, filename, **kwargs):
        asked.append((repo_id, filename))
        return real(repo_id, filename, **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert cli_main(["doctor", "--model", "owner/tiny", *SMALL, "--json"]) == 0
    by_id = json.loads(capsys.readouterr().out)
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "config.json").write_text(json.dumps(config))
    assert cli_main(["doctor", "--model", str(tmp_path / "local"), *SMALL, "--json"]) == 0
    assert by_id == json.loads(capsys.readouterr().out)
    assert asked == [("owner/tiny", "config.json")]  # the config only, never weights

    assert cli_main(["doctor", "--model", "owner/absent"]) == 2
    err = capsys.readouterr().err
    assert "could not get config.json of the Hub model 'owner/absent'" in err and "Traceback" not in err


@pytest.mark.parametrize("argv", [
    ["doctor", "--model", "llama-3.1-70b", "--world-size", "4", "--gpu-memory-gb", "8", "--dataset-size", "50"],
    ["doctor", "--model", "qwen2.5-0.5b", "--gpu-memory-gb", "2", "--reward-model", "llama-3.1-8b", *SMALL],
    ["doctor", "--model", "llama-3.1-70b", "--world-size", "4", "--gpu-memory-gb", "24", *SMALL, "--plan"],
    ["doctor", "--help"],
])
def test_no_codes_in_what_a_user_reads(capsys, argv):
    with contextlib.suppress(SystemExit):
        cli_main(argv)
    captured = capsys.readouterr()
    assert not re.search(r"\bS\d\b", captured.out + captured.err), captured.out + captured.err


def test_no_codes_in_the_packages_strings():
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "grpo_patches").rglob("*.py"))
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bS\d\b", line)]
    assert not found, f"undefined section codes (S4, S8, ...) where users read them: {found}"
