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
