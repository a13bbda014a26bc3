"""The wheel a user installs: every subpackage, the kernel sources and a working `paged-hf serve`.

The test venv's editable install finds any package a wheel leaves out, so this builds the wheel and installs
it (--no-deps) into a fresh venv. Its dependencies come from the test venv's site-packages through a `.pth`
line written after the install (nothing is downloaded; a path line in a `.pth` does not run the editable
install's own `.pth` hook). Every command runs outside the source tree without PYTHONPATH, and every
`paged_hf` module it imports must come from the fresh venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest
from conftest import tiny_model

ROOT = Path(__file__).resolve().parent.parent
#: import name -> source folder, as pyproject.toml maps them
FOLDERS = {"paged_hf": "paged_hf", "paged_hf.kernels": "kernels", "paged_hf.integrations": "integrations"}


def source_packages() -> list[str]:
    """Every package of the source tree by import name: the three roots (kernels/ and integrations/ have no
    __init__.py, see paged_hf/source_layout.py) and each folder with an __init__.py under them."""
    names = list(FOLDERS)
    for name, folder in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            parts = init.parent.relative_to(ROOT / folder).parts
            if parts:
                names.append(".".join((name, *parts)))
    return names


def run(*args, cwd, timeout=300, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(fresh venv folder, wheel path): the wheel built from a copy of the sources, installed alone."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "build", "*.egg-info")
    for folder in set(FOLDERS.values()):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "README.md"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", src, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("paged_hf-*.whl")
    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp)
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel, cwd=tmp)
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp).stdout.strip())
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "test_venv_dependencies.pth").write_text("".join(f"{path}\n" for path in deps))
    return venv, site, wheel


def test_the_wheel_holds_every_package_and_nothing_at_the_top_level(installed):
    _, _, wheel = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert all(n.startswith(("paged_hf/", "paged_hf-")) for n in names), sorted({n.split("/")[0] for n in names})
    packaged = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith(".py")}
    assert set(source_packages()) <= packaged, sorted(set(source_packages()) - packaged)
    sources = {f"paged_hf/kernels/csrc/{p.name}" for p in (ROOT / "kernels" / "csrc").glob("*.[ch]*")}
    assert sources and sources <= set(names)


def test_every_subpackage_imports_from_the_fresh_venv(installed):
    venv, site, _ = installed
    check = (
        "import importlib, json, sys\n"
        f"names = {source_packages()!r}\n"
        "modules = {n: importlib.import_module(n) for n in names}\n"
        "files = {n: m.__file__ or list(m.__path__)[0] for n, m in modules.items()}  # a namespace: its folder\n"
        "from paged_hf.kernels import native\n"
        "files['csrc'] = str(native.SOURCE) if native.SOURCE.exists() else None\n"
        "files['loaded'] = [m.__file__ for k, m in sys.modules.items() if k.startswith('paged_hf') and m.__file__]\n"
        "print(json.dumps(files))\n"
    )
    files = json.loads(run(venv / "bin" / "python", "-I", "-c", check, cwd=venv).stdout)
    loaded = files.pop("loaded")
    assert files["csrc"] is not None, "csrc/paged_decode.cpp is not next to the installed kernels"
    assert all(str(f).startswith(str(site)) for f in [*files.values(), *loaded]), files


def test_paged_hf_serve_from_the_wheel_answers_a_request(installed, tmp_path):
    from tiny_server import free_port, tiny_tokenizer  # noqa: PLC0415

    venv, _, _ = installed
    model_dir = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    port = free_port()
    # read while the server writes: a multi-byte character (a progress bar's) may be cut at the end
    log = open(tmp_path / "serve.log", "w+", encoding="utf-8", errors="replace")
    server = subprocess.Popen(
        [venv / "bin" / "paged-hf", "serve", "--model", model_dir, "--dtype", "float64", "--port", str(port),
         "--num-blocks", "8", "--log-level", "warning"],
        cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")})
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(base, server, log)
        body = json.dumps({"model": "tiny-llama", "prompt": "the cat", "max_tokens": 3, "temperature": 0})
        request = urllib.request.Request(f"{base}/v1/completions", body.encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.load(response)
        assert answer["usage"]["completion_tokens"] == 3, answer
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as response:
            assert [card["id"] for card in json.load(response)["data"]] == ["tiny-llama"]  # the name, not the path
        log.seek(0)
        assert "max_model_len 128)" in log.read()  # 8 blocks of 16 tokens, not the model's 512 positions
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def wait_until_healthy(base: str, server: subprocess.Popen, log, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5):
                return
        except OSError:
            log.seek(0)
            assert server.poll() is None, f"paged-hf serve exited:\n{log.read()}"
            assert time.monotonic() < deadline, f"paged-hf serve did not start:\n{log.read()}"
            time.sleep(0.5)
