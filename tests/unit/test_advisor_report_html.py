"""`tessera advise --report FILE.html`: the markdown report as one self-contained page, its tables
as HTML tables and its plots inlined byte for byte."""

from __future__ import annotations

import base64
from html.parser import HTMLParser

import pytest

from tessera.advisor.report import markdown_to_html, render_report
from tessera.advisor.trace import synthesize
from tests.unit.test_advisor_advise import info, run  # noqa: F401  (info: the module's model fixture)


class Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, int] = {}
        self.images: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        self.tags[tag] = self.tags.get(tag, 0) + 1
        attrs = dict(attrs)
        if tag == "img":
            self.images.append(attrs["src"])
        for key in ("href", "src"):
            if key in attrs and tag != "img":
                self.links.append(attrs[key])


def test_html_report_is_self_contained(info, tmp_path):  # noqa: F811
    pytest.importorskip("matplotlib")
    pytest.importorskip("markdown")
    profile, advice = run(info, synthesize("chatbot", 12, rate=20.0, vocab_size=info.config.vocab_size,
                                           length_scale=0.3))
    md = render_report(profile, advice, tmp_path / "report_plots")
    page = Collect()
    page.feed(markdown_to_html(md, tmp_path))
    assert page.tags.get("table", 0) == md.count("\n|---") and page.tags["h2"] >= 6
    inlined = [base64.b64decode(src.removeprefix("data:image/png;base64,")) for src in page.images]
    assert all(src.startswith("data:image/png;base64,") for src in page.images)
    on_disk = [(tmp_path / "report_plots" / n).read_bytes() for n in ("lengths.png", "hit_rate.png", "kv_usage.png")]
    assert inlined == on_disk
    assert not page.links  # no stylesheet, script or link to fetch
