"""Plain prose from a MediaWiki XML export: the encyclopedia evaluation set of the cross-domain benchmarks.

The gensim wheel on PyPI carries a shortened English Wikipedia dump for its own tests
(`gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`:
106 articles, 6 MB of markup). `plain_articles` turns it into what a reader sees: the
article's body paragraphs, without templates, references, tables, files, lists, headings or the
trailing See also / References sections. Its job is a faithful enough English text to measure
perplexity on, not a full wikitext parser: markup it does not know is left in place, and
paragraphs with fewer than `min_words` words (residue, captions, one-line stubs) are dropped.
"""
from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET
from typing import Iterable, Iterator

#: Sections after which an article is references, links and lists, not prose.
TAIL_SECTIONS = ("see also", "references", "notes", "external links", "further reading", "bibliography",
                 "sources", "citations", "footnotes", "notes and references", "works cited")
#: Link namespaces whose target is not text in the article (files, categories, other languages).
_DROPPED_LINKS = re.compile(r"^\s*(file|image|category|media|wikt|[a-z]{2,3}(-[a-z]+)?)\s*:", re.I)

_COMMENT = re.compile(r"<!--.*?-->", re.S)
_REF_PAIR = re.compile(r"<ref\b[^>/]*>.*?</ref\s*>", re.S | re.I)
_REF_SINGLE = re.compile(r"<ref\b[^>]*/>", re.I)
_DROPPED_TAGS = re.compile(r"<(math|gallery|timeline|score|syntaxhighlight|source|pre|code|chem|imagemap|hiero)"
                           r"\b[^>]*>.*?</\1\s*>", re.S | re.I)
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_TABLE = re.compile(r"\{\|[^{}]*?\|\}", re.S)
_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_EXTERNAL = re.compile(r"\[(?:https?:)?//[^\s\]]+\s*([^\]]*)\]")
_EMPHASIS = re.compile(r"'{2,}")
_HEADING = re.compile(r"^(=+)\s*(.*?)\s*\1\s*$")
_SPACES = re.compile(r"[ \t\u00a0]+")
_EMPTY_BRACKETS = re.compile(r"\(\s*[,;]?\s*\)")
_SPACE_PUNCT = re.compile(r"\s+([,.;:!?)])")


def _until_stable(pattern: re.Pattern, repl, text: str) -> str:
    """Apply `pattern` until nothing changes (nested templates and links come apart inside out)."""
    while True:
        new = pattern.sub(repl, text)
        if new == text:
            return text
        text = new


def _link_text(m: re.Match) -> str:
    inner = m.group(1)
    if _DROPPED_LINKS.match(inner):
        return ""
    return inner.split("|")[-1]


def strip_markup(wikitext: str) -> str:
    """The inline markup of one article removed: what is left is text, headings and list lines."""
    t = _COMMENT.sub("", wikitext)
    t = _REF_PAIR.sub("", t)
    t = _REF_SINGLE.sub("", t)
    t = _DROPPED_TAGS.sub("", t)
    t = _until_stable(_TEMPLATE, "", t)
    t = _until_stable(_TABLE, "", t)
    t = _until_stable(_LINK, _link_text, t)
    t = _EXTERNAL.sub(lambda m: m.group(1), t)
    t = _TAG.sub("", t)
    t = _EMPHASIS.sub("", t)
    return html.unescape(t)  # entities the export kept escaped (&nbsp;, &ndash;)


def article_paragraphs(wikitext: str, min_words: int = 20) -> list[str]:
    """The body paragraphs of one article, in order, up to its first tail section (See also, ...)."""
    out: list[str] = []
    for line in strip_markup(wikitext).splitlines():
        line = line.strip()
        heading = _HEADING.match(line)
        if heading:
            if heading.group(2).strip().lower() in TAIL_SECTIONS:
                break
            continue
        if not line or line[0] in "*#:;|!{}[":
            continue  # lists, indented quotes, table rows and what is left of unbalanced markup
        line = _SPACE_PUNCT.sub(r"\1", _EMPTY_BRACKETS.sub("", _SPACES.sub(" ", line))).strip()
        if len(line.split()) >= min_words and "{{" not in line and "}}" not in line:
            out.append(line)
    return out


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def pages(xml_text: str) -> Iterator[tuple[str, str]]:
    """(title, wikitext) of every article of a MediaWiki export: namespace 0, redirects left out."""
    root = ET.fromstring(xml_text)
    for page in root.iter():
        if _local(page.tag) != "page":
            continue
        fields = {_local(c.tag): c for c in page}
        if (fields.get("ns") is not None and (fields["ns"].text or "0").strip() != "0") or "redirect" in fields:
            continue
        text = next((c.text or "" for c in page.iter() if _local(c.tag) == "text"), "")
        if text.lstrip().lower().startswith("#redirect"):
            continue
        yield (fields["title"].text or "" if "title" in fields else ""), text


def plain_articles(xml_text: str, min_words: int = 20) -> list[str]:
    """Every article with at least one paragraph left: its paragraphs joined by newlines."""
    out = []
    for _, text in pages(xml_text):
        paragraphs = article_paragraphs(text, min_words)
        if paragraphs:
            out.append("\n".join(paragraphs))
    return out


def joined(articles: Iterable[str]) -> str:
    """Articles separated by a blank line (one .txt evaluation text)."""
    return "\n\n".join(articles) + "\n"
