"""CPU: docs/cli.md holds the option table exactly as ``launch/decode.py
--markdown-options`` prints it from the parser (one table, generated), and the README keeps
no second one."""

import re
import subprocess
import sys
from pathlib import Path

from launch import decode

ROOT = Path(__file__).resolve().parent.parent


def test_cli_page_holds_the_parsers_table():
    text = (ROOT / "docs" / "cli.md").read_text()
    m = re.search(r"<!-- options: [^\n]*-->\n(.*?)<!-- end options -->", text, re.S)
    assert m, "docs/cli.md: no options block"
    want = decode.options_markdown()
    assert m.group(1) == want, (
        "docs/cli.md's table is stale: python launch/decode.py --markdown-options"
    )
    for option in re.findall(r"--[a-z][a-z-]*", "".join(decode.parser().format_help())):
        if option not in ("--help", "--markdown-options"):
            assert f"`{option}" in want or f"/ `{option}" in want, option


def test_markdown_options_flag_prints_the_table():
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "decode.py"), "--markdown-options"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == decode.options_markdown()


def test_readme_has_no_option_table():
    readme = (ROOT / "README.md").read_text()
    assert not re.search(r"^\| `--", readme, re.M), "README.md: the option table is docs/cli.md's"
