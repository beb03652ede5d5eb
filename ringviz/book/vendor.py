"""(Re)vendor the JavaScript the rendered book needs to draw widgets offline.

``python -m ringviz.book.vendor`` fetches pinned npm packages with ``npm pack`` (the npm registry
checks each tarball's integrity), takes anywidget's AMD module from the installed anywidget
wheel, checks every file against the sha256 pinned below, and writes them with their licenses
and a ``VERSIONS.json`` into :data:`TARGET`. The book serves that folder through
``html_extra_path`` and loads the scripts via myst-nb's ``nb_ipywidgets_js`` (see _config.yml),
never from ``_static/`` (Jupyter Book 1 injects every ``_static/*.js`` into every page).

``python -m ringviz.book.vendor --check`` only verifies the vendored files against VERSIONS.json.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

TARGET = pathlib.Path(__file__).parent / "web" / "_static" / "ringviz-widgets"

# name: (version, license, {file in the npm tarball: (path under TARGET, sha256)})
NPM = {
    "requirejs": ("2.3.8", "MIT", {
        "package/require.js": (
            "require.js", "c1fc6b1d53af7522f78d664922abb32acac64ed0ecccb8f907f1e6fc7262563a"),
    }),
    "@jupyter-widgets/html-manager": ("1.0.15", "BSD-3-Clause", {
        "package/dist/embed-amd.js": (
            "embed-amd.js", "ca87dff57c70ffb2658794fde0eab0e27e5f5472a1f5df7ab2b08e1039fc4b72"),
        "package/dist/embed.js.LICENSE.txt": (
            "LICENSES/html-manager-bundled.txt",
            "aed2008aae8123157c4ae564883166b1af7bab928d504a1fa7de1f67aec11268"),
        # the bundle's Font Awesome 5 CSS asks for these (solid, regular, brands) beside its
        # two modules' URLs, which ringviz-widgets.js maps to html-manager/; byte-identical to
        # fontawesome-free 5.15.4's webfonts/fa-*.woff2. Browsers without woff2 get no icons.
        "package/dist/1551f4f60c37af51121f.woff2": (
            "html-manager/1551f4f60c37af51121f.woff2",
            "9834b82ad26e2a37583d22676a12dd2eb0fe7c80356a2114d0db1aa8b3899537"),
        "package/dist/7a3337626410ca2f4071.woff2": (
            "html-manager/7a3337626410ca2f4071.woff2",
            "e42a88444448ac3d60549cc7c1ff2c8a9cac721034c073d80a14a44e79730cca"),
        "package/dist/d878b0a6a1144760244f.woff2": (
            "html-manager/d878b0a6a1144760244f.woff2",
            "8ea8791754915a898a3100e63e32978a6d1763be6df8e73a39d3a90d691cdeef"),
    }),
    # only for its license: fonts SIL OFL 1.1 (the files above are its webfonts)
    "@fortawesome/fontawesome-free": ("5.15.4", "OFL-1.1 (fonts)", {
        "package/LICENSE.txt": (
            "LICENSES/fontawesome-free.txt",
            "e779748dfe75e84f974df3c7bc07f842011a100159158b0f1f49b2f2a5a515cb"),
    }),
}
ANYWIDGET = ("0.11.0", "MIT", "anywidget/index.js",
             "b257c384632cd992e1758322ccaeeb6de8af7d57c0173efd462fc93041f9f5b6")

# requirejs's npm tarball ships no LICENSE file; its header says "Released under MIT license".
REQUIREJS_LICENSE = """MIT License

Copyright jQuery Foundation and other contributors, https://jquery.org/

Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
associated documentation files (the "Software"), to deal in the Software without restriction,
including without limitation the rights to use, copy, modify, merge, publish, distribute,
sublicense, and/or sell copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all copies or
substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, INCLUDING BUT
NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR PURPOSE AND
NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM,
DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM, OUT
OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE SOFTWARE.
"""


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _place(src: pathlib.Path, rel: str, want: str, target: pathlib.Path) -> dict:
    """Copy ``src`` to ``target/rel`` after checking its sha256 against the pin."""
    got = sha256(src)
    if got != want:
        raise RuntimeError(f"{src.name}: sha256 {got} does not match the pinned {want}")
    dest = target / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dest)
    return {"path": rel, "sha256": got, "bytes": dest.stat().st_size}


def _npm(name: str, version: str, work: pathlib.Path) -> pathlib.Path:
    """``npm pack name@version`` into ``work`` and unpack it; return the unpack folder."""
    out = subprocess.run(["npm", "pack", f"{name}@{version}", "--json", "--silent"], cwd=work,
                         check=True, capture_output=True, text=True).stdout
    tgz = work / json.loads(out)[0]["filename"]
    dest = work / tgz.stem
    with tarfile.open(tgz) as tar:
        tar.extractall(dest, filter="data")
    return dest


def _dist_file(dist: str, name: str) -> pathlib.Path:
    """A file of an installed distribution (licenses, shared data)."""
    for f in importlib.metadata.files(dist) or ():
        if f.name == name or str(f).endswith(name):
            return pathlib.Path(f.locate())
    raise FileNotFoundError(f"{name} not found in the installed {dist} distribution")


def vendor(target: pathlib.Path = TARGET) -> dict:
    """Fetch, verify and write every served file plus licenses; return the VERSIONS record."""
    record: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (version, license_id, files) in NPM.items():
            root = _npm(name, version, pathlib.Path(tmp))
            placed = [_place(root / src, rel, want, target)
                      for src, (rel, want) in files.items()]
            record[name] = {"version": version, "license": license_id, "source": "npm pack",
                            "files": placed}
    (target / "LICENSES").mkdir(parents=True, exist_ok=True)
    (target / "LICENSES" / "requirejs.txt").write_text(REQUIREJS_LICENSE)
    # html-manager lives in the ipywidgets repository, under ipywidgets' BSD-3-Clause license
    shutil.copyfile(_dist_file("ipywidgets", "LICENSE"), target / "LICENSES" / "html-manager.txt")
    version, license_id, rel, want = ANYWIDGET
    if importlib.metadata.version("anywidget") != version:
        raise RuntimeError(f"installed anywidget {importlib.metadata.version('anywidget')} is "
                           f"not the pinned {version}")
    module = _dist_file("anywidget", "nbextensions/anywidget/index.js")
    record["anywidget"] = {"version": version, "license": license_id,
                           "source": "anywidget wheel, share/jupyter/nbextensions/anywidget",
                           "files": [_place(module, rel, want, target)]}
    shutil.copyfile(_dist_file("anywidget", "LICENSE"), target / "LICENSES" / "anywidget.txt")
    (target / "VERSIONS.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def check(target: pathlib.Path = TARGET) -> list[str]:
    """Problems with the vendored files (missing, or sha256 differs from VERSIONS.json)."""
    versions = json.loads((target / "VERSIONS.json").read_text())
    problems = []
    for name, entry in versions.items():
        for f in entry["files"]:
            path = target / f["path"]
            if not path.is_file():
                problems.append(f"{name}: {f['path']} missing")
            elif sha256(path) != f["sha256"]:
                problems.append(f"{name}: {f['path']} sha256 differs from VERSIONS.json")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only verify the vendored files")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        print("\n".join(problems) or f"ok: {TARGET}")
        return 1 if problems else 0
    record = vendor()
    total = sum(f["bytes"] for e in record.values() for f in e["files"])
    print(f"vendored {len(record)} packages, {total / 1e6:.2f} MB into {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
