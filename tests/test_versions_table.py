"""The README's supported-versions table is the one generated from compat.json (listed once)."""

from pathlib import Path

from grpo_patches.cli import versions_table

ROOT = Path(__file__).resolve().parents[1]


def test_readme_table_is_generated_from_compat_json():
    assert versions_table() in (ROOT / "README.md").read_text(), (
        "README.md's table is stale: paste the output of `grpo-patches versions`"
    )


def test_every_release_row_names_an_era_and_pins():
    from grpo_patches import compat

    for release, row in compat.table()["supported"].items():
        assert row["era"] and all(row[name] for name in compat.PINNED), release
