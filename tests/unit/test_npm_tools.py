"""tests/conformance/npm_tools.py: a real-CLI test whose CLI cannot be had fails under CI and skips elsewhere, so
the conformance suite cannot pass in CI without running. `npm` here is a stand-in script on PATH that behaves
like npm's three outcomes (installs the bin, fails, installs without a bin); the helper runs it as it runs npm."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FAKE_NPM = """#!/bin/sh
# npm install --no-audit --no-fund --prefix PREFIX PACKAGE, as npm_tools calls it
prefix=""
while [ $# -gt 0 ]; do
  if [ "$1" = "--prefix" ]; then prefix="$2"; shift; fi
  pkg="$1"; shift
done
case "$MODE" in
  fail) echo "npm ERR! 404 Not Found - GET https://registry.npmjs.org/$pkg" >&2; exit 1 ;;
  nobin) mkdir -p "$prefix/node_modules/$pkg"; exit 0 ;;
  ok) sleep "${DELAY:-0}"; echo "$pkg" >> "$prefix.calls"; mkdir -p "$prefix/node_modules/.bin"; printf '#!/bin/sh\\n' > "$prefix/node_modules/.bin/tool";
      chmod +x "$prefix/node_modules/.bin/tool"; exit 0 ;;
esac
"""


@pytest.fixture
def npm_tools(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "conformance"))
    import npm_tools

    return npm_tools


@pytest.fixture
def fake_npm(tmp_path, monkeypatch):
    """A `npm` on PATH whose outcome is chosen per test with MODE."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    npm = bindir / "npm"
    npm.write_text(FAKE_NPM)
    npm.chmod(npm.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ.get('PATH', '')}")
    return lambda mode: monkeypatch.setenv("MODE", mode)


@pytest.mark.parametrize("ci", ["true", "1", "yes"])
def test_no_npm_fails_under_ci(npm_tools, tmp_path, monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no npm anywhere
    with pytest.raises(pytest.fail.Exception, match="CI requires this conformance test to run: npm is not installed"):
        npm_tools.npm_bin(tmp_path / "prefix", "some-cli", "tool")


@pytest.mark.parametrize("ci", [None, "", "0", "false", "FALSE"])
def test_no_npm_skips_outside_ci(npm_tools, tmp_path, monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(pytest.skip.Exception, match="npm is not installed"):
        npm_tools.npm_bin(tmp_path / "prefix", "some-cli", "tool")


def test_a_failed_install_fails_under_ci_with_npms_words(npm_tools, fake_npm, tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    fake_npm("fail")
    with pytest.raises(pytest.fail.Exception, match="npm could not install some-cli: npm ERR! 404"):
        npm_tools.npm_bin(tmp_path / "prefix", "some-cli", "tool")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="npm could not install some-cli"):
        npm_tools.npm_bin(tmp_path / "prefix", "some-cli", "tool")


def test_an_install_without_the_executable_fails_under_ci(npm_tools, fake_npm, tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    fake_npm("nobin")
    with pytest.raises(pytest.fail.Exception, match="npm installed some-cli but no node_modules/.bin/tool"):
        npm_tools.npm_bin(tmp_path / "prefix", "some-cli", "tool")


def test_an_installed_cli_is_returned_and_not_reinstalled(npm_tools, fake_npm, tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    fake_npm("ok")
    prefix = tmp_path / "prefix"
    path = npm_tools.npm_bin(prefix, "some-cli", "tool")
    assert path == prefix / "node_modules" / ".bin" / "tool" and os.access(path, os.X_OK)
    fake_npm("fail")  # a second call finds it installed and does not run npm again
    assert npm_tools.npm_bin(prefix, "some-cli", "tool") == path


def test_a_prefetched_install_is_waited_for_not_repeated(npm_tools, fake_npm, tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    fake_npm("ok")
    monkeypatch.setenv("DELAY", "0.5")  # still installing when the test asks for it
    prefix = tmp_path / "prefix"
    spec = (prefix, "some-cli", prefix / "node_modules" / ".bin" / "tool", None)
    thread = npm_tools.prefetch([spec])
    assert npm_tools.npm_bin(prefix, "some-cli", "tool").exists()
    thread.join(10)
    assert (tmp_path / "prefix.calls").read_text() == "some-cli\n"  # npm ran once


def test_a_failed_prefetch_is_reported_by_the_test_that_needs_it(npm_tools, fake_npm, tmp_path, monkeypatch):
    monkeypatch.setenv("CI", "true")
    fake_npm("fail")
    prefix = tmp_path / "prefix"
    spec = (prefix, "some-cli", prefix / "node_modules" / ".bin" / "tool", None)
    npm_tools.prefetch([spec, spec]).join(10)  # both failed, quietly
    with pytest.raises(pytest.fail.Exception, match="npm could not install some-cli"):
        npm_tools.ensure(spec)
