#!/usr/bin/env python3
"""Doxygen's input filter for gradsync's public headers (docs/Doxyfile's INPUT_FILTER).

The headers are written for people reading them: plain `//` comments above what they describe,
and `// ...` after a member on its line. Doxygen reads only its own comment forms, so this filter
hands it the same text with the comments marked, and changes nothing else:
  * the first comment block of a file, its top comment, becomes the file's documentation
    (`/// @file` on a line before it: the rest of the file's line numbers move by one);
  * in comment text, < and > are escaped: `<folder>/rank<R>.json` is a path, not HTML;
  * a comment line on its own (`  // text`) becomes `  /// text`: the documentation of what
    follows it;
  * a comment after code on the same line (`int x = 0;  // text`) becomes `///< text`: the
    documentation of that member (and so do its continuation lines, comments under it in the
    same column);
  * a declaration right under another of the same name, with no comment of its own (a const
    overload, say), is marked `/** @overload */`: it shares the first one's documentation;
  * comments inside a function body are left alone (implementation notes, not documentation);
  * a deleted copy constructor or assignment (`X(const X&) = delete;`) is hidden: it says what
    the class does not do and needs no entry of its own.

    scripts/doxygen_filter.py HEADER     prints the filtered header
"""
import re
import sys

OWN_LINE = re.compile(r"^(\s*)//(?!/)(.*)$")
TRAILING = re.compile(r"^(.*?\S.*?)(\s+)//(?!/)(?!<)(.*)$")
DELETED = re.compile(r"^\s*(.*\boperator=\s*)?.*\(const \w+&\)\s*=\s*delete;\s*$")


def text(comment):
    """A comment's text as Doxygen reads it literally: <folder> and <R> are words here, not HTML."""
    return comment.replace("<", "\\<").replace(">", "\\>")


def filter_header(lines):
    out = []
    at_top = True      # still in the file's top comment
    depth = 0          # braces of function bodies (a class's or namespace's braces are not counted)
    trailing_column = -1  # where the last line's trailing comment began (-1: it had none)
    previous_name = None  # the name the last statement declared, when it was a declaration
    statement_name = None  # the name the statement under way declares ("" when none)
    for line in lines:
        code = line.split("//", 1)[0]
        if at_top:
            match = OWN_LINE.match(line)
            if match:
                # "@file" on the top comment's first line, before its text (the only place the
                # filter moves a line number: by one, in the rest of the file).
                out.append(("/// @file\n" if not out else "") + match.group(1) + "///" + text(match.group(2)))
                continue
            at_top = False
        if depth > 0:
            out.append(line)
        elif DELETED.match(line):
            out.append("")
        else:
            own = OWN_LINE.match(line)
            trailing = TRAILING.match(line) if not own else None
            if own and len(own.group(1)) == trailing_column:
                # A trailing comment continued on the next line, under its first line.
                out.append(own.group(1) + "///<" + text(own.group(2)))
            elif own:
                out.append(own.group(1) + "///" + text(own.group(2)))
                trailing_column = -1
            elif trailing and '"' not in trailing.group(1):
                out.append(overload(trailing.group(1), previous_name) + trailing.group(2) + "///<" + text(trailing.group(3)))
                trailing_column = len(trailing.group(1)) + len(trailing.group(2))
            else:
                out.append(overload(line, previous_name))
                trailing_column = -1
        # The name the statement ending here declared (continuation lines keep it); a blank or
        # comment line ends the run of declarations an overload may follow.
        if depth > 0 or not code.strip():
            previous_name, statement_name = (previous_name if depth > 0 else None), None
        else:
            if statement_name is None:
                statement_name = declared_name(code) or ""
            if code.rstrip().endswith((";", "}", "{")):
                previous_name, statement_name = statement_name or None, None
        depth = update_depth(depth, code)
    return out


DECLARED = re.compile(r"(~?\w+|operator\s*[^\s(]+)\s*\(")
NOT_NAMES = {"if", "for", "while", "switch", "return", "sizeof", "decltype", "static_assert", "alignas"}


def declared_name(code):
    """The name a line declares, when it starts a function declaration; None otherwise."""
    stripped = code.strip()
    if not stripped or stripped.startswith(("#", "return", "using", "friend", "template")):
        return None
    match = DECLARED.search(stripped)
    if not match or match.group(1) in NOT_NAMES:
        return None
    return match.group(1)


def overload(line, previous_name):
    """`line` marked as an overload of the declaration above it, when it is one."""
    code = line.split("//", 1)[0]
    name = declared_name(code)
    if name is None or name != previous_name:
        return line
    indent = len(line) - len(line.lstrip())
    return line[:indent] + "/** @overload */ " + line[indent:]


FUNCTION_OPEN = re.compile(r"\)\s*(const\s*)?(noexcept\s*)?(override\s*)?(->\s*[\w:<>&*\s]+)?\{")


def update_depth(depth, code):
    """Counts the braces of function bodies: an open brace after a parameter list starts one."""
    if depth > 0:
        return max(0, depth + code.count("{") - code.count("}"))
    if FUNCTION_OPEN.search(code) or re.search(r"\)\s*:\s*\w+\(.*\{", code):
        return max(0, code.count("{") - code.count("}"))
    return 0


def main():
    with open(sys.argv[1], encoding="utf-8") as header:
        lines = header.read().split("\n")
    sys.stdout.write("\n".join(filter_header(lines)))


if __name__ == "__main__":
    main()
