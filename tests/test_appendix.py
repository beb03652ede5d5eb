"""The appendix maps seed 001's checklist to tests: every test it names must exist."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
APPENDIX = ROOT / "book" / "appendix_checklist.md"
CITED = re.compile(r"`(tests/(?:\w+/)?test_\w+\.py)::(test_\w+)`")


def test_appendix_names_only_existing_tests():
    cited = CITED.findall(APPENDIX.read_text(encoding="utf-8"))
    assert len(cited) >= 10, "the appendix should cite the tests that enforce the checklist"
    missing = [f"{path}::{name}" for path, name in cited
               if not (ROOT / path).is_file()
               or not re.search(rf"^def {name}\(", (ROOT / path).read_text(encoding="utf-8"),
                                re.MULTILINE)]
    assert not missing, f"the appendix cites tests that do not exist: {missing}"


def test_every_checklist_item_has_a_section():
    headings = re.findall(r"^## (\d)\. ", APPENDIX.read_text(encoding="utf-8"), re.MULTILINE)
    assert headings == [str(i) for i in range(1, 7)]  # seed 001 lists six items
