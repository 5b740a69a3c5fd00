"""benchmarks/wikitext.py: the Wikipedia evaluation set of the cross-domain benchmarks is plain prose."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import wikitext  # noqa: E402

WORDS = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen"

ARTICLE = f"""{{{{Infobox person|name=Ada {{{{nowrap|Lovelace}}}}|born=1815}}}}
'''Ada Lovelace''' was an [[England|English]] [[mathematician]]<ref name="a">{{{{cite book|title=X}}}}</ref> and \
writer, chiefly known for her work on the [[Analytical Engine]]<ref>Plain ref.</ref> of {WORDS}.
[[File:Ada.jpg|thumb|A [[portrait]] caption that must go]]
<!-- an editor's comment -->
== Early life ==
Her father was [[Lord Byron]]; see [http://example.org the archive] for letters&nbsp;and ''more'' about {WORDS}.
* a list item with many words that is not prose and is dropped although it is long enough to pass
{{| class="wikitable"
|-
| a table cell with many words that is not prose and is dropped although it is long enough
|}}
Too short to keep.
<math>x^2 + {{{{y}}}}</math>Formulas go, the sentence after them stays with {WORDS}.
== See also ==
The tail section holds links and lists, not prose, even when it is a long line of {WORDS}.
[[Category:Mathematicians]]
"""


def test_article_paragraphs_are_the_body_prose_without_markup():
    paragraphs = wikitext.article_paragraphs(ARTICLE)
    assert paragraphs == [
        f"Ada Lovelace was an English mathematician and writer, chiefly known for her work on the Analytical "
        f"Engine of {WORDS}.",
        f"Her father was Lord Byron; see the archive for letters and more about {WORDS}.",
        f"Formulas go, the sentence after them stays with {WORDS}.",
    ]


def test_strip_markup_unwraps_nested_templates_and_links_inside_out():
    text = wikitext.strip_markup("a {{outer|{{inner|x}}}} b [[File:f.png|thumb|[[c]] caption]] c [[d|e]] f")
    assert text == "a  b  c e f"


def test_pages_skip_redirects_and_other_namespaces():
    ns = "http://www.mediawiki.org/xml/export-0.10/"
    body = f"Body text of {WORDS} here."
    xml = f"""<mediawiki xmlns="{ns}">
<page><title>Kept</title><ns>0</ns><revision><text>{body}</text></revision></page>
<page><title>Redirected</title><ns>0</ns><redirect title="Kept" /><revision><text>#REDIRECT [[Kept]]</text></revision></page>
<page><title>Talk:Kept</title><ns>1</ns><revision><text>{body}</text></revision></page>
<page><title>Empty</title><ns>0</ns><revision><text>Too short.</text></revision></page>
</mediawiki>"""
    assert [t for t, _ in wikitext.pages(xml)] == ["Kept", "Empty"]
    articles = wikitext.plain_articles(xml)
    assert articles == [body]
    assert wikitext.joined(articles + articles) == f"{body}\n\n{body}\n"


def test_gensim_texts_are_fetched_in_one_download_and_cached(tmp_path, monkeypatch):
    """A fresh machine downloads the gensim wheel once for the news and the wiki sets, not once each;
    afterwards both are read from the cache."""
    import bz2

    import bench_cross_domain as bench

    ns = "http://www.mediawiki.org/xml/export-0.10/"
    body = f"Body text of {WORDS} here."
    xml = f'<mediawiki xmlns="{ns}"><page><title>A</title><ns>0</ns><revision><text>{body}</text></revision></page>' \
          "</mediawiki>"
    members = {bench.LEE_MEMBER: b"First news line.\nSecond news line.\n",
               bench.WIKI_MEMBER: bz2.compress(xml.encode())}
    calls = []

    def fake_fetch(wanted):
        calls.append(list(wanted))
        return {m: members[m] for m in wanted}, {"wheel": "gensim-fake.whl", "wheel_sha256": "0" * 64}

    monkeypatch.setattr(bench, "_gensim_members", fake_fetch)
    wiki_path, wiki_meta = bench.wiki_text(tmp_path)
    news_path, news_meta = bench.news_text(tmp_path)
    assert calls == [[bench.LEE_MEMBER, bench.WIKI_MEMBER]]  # one download for both
    assert wiki_path.read_text(encoding="utf-8") == f"{body}\n" and wiki_meta["articles"] == 1
    assert news_meta["lines"] == 2 and news_meta["member"] == bench.LEE_MEMBER
    assert wiki_meta["member"] == bench.WIKI_MEMBER and wiki_meta["wheel"] == "gensim-fake.whl"
    bench.news_text(tmp_path)
    bench.wiki_text(tmp_path)
    assert len(calls) == 1  # cached
