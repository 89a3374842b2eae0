"""Rewrite the settings table of docs/configuration.md from `Settings` (`make settings-table`)."""

from __future__ import annotations

import sys
from pathlib import Path

from clairvoyant.config import CLI_FLAGS, ENV_PREFIX, Settings

START_MARK = "<!-- settings-reference:start"
END_MARK = "<!-- settings-reference:end -->"


def settings_reference_markdown() -> str:
    """docs/configuration.md's table, generated from ``Settings`` (a test keeps them equal)."""
    rows = [
        "| setting | environment variable | flag | default | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, field in Settings.model_fields.items():
        default = "unset" if field.default is None else f"`{field.get_default(call_default_factory=True)}`"
        flag = f"`{CLI_FLAGS[name]}`" if name in CLI_FLAGS else ""
        meaning = " ".join((field.description or "").split())  # a docstring's lines, as one
        rows.append(f"| `{name}` | `{ENV_PREFIX}{name.upper()}` | {flag} | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


def with_settings_table(page: str) -> str:
    """The page with the text between its two markers replaced by the generated table."""
    start = page.index("\n", page.index(START_MARK)) + 1
    end = page.index(END_MARK)
    return page[:start] + settings_reference_markdown() + page[end:]


def main(argv: list[str] | None = None) -> int:
    (path,) = argv if argv is not None else sys.argv[1:] or ["docs/configuration.md"]
    page = Path(path)
    page.write_text(with_settings_table(page.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
