// A small Markdown subset rendered straight into DOM nodes: the model's text only ever becomes text nodes (no
// innerHTML anywhere), so markup in an answer shows as written. Blocks: fenced code, headings, lists, quotes, rules,
// paragraphs; inline: code, bold, italic, links (http, https and mailto only, opened with rel="noopener").

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^( {0,3})([-*+]|(\d{1,9})[.)])\s+(.*)$/;
const INLINE = new RegExp([
  /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source, // 1, 2: code
  /\[([^\]\n]+)\]\(\s*<?([^\s()<>]+)>?\s*\)/.source, // 3, 4: link
  /\*\*(?=\S)([\s\S]*?\S)\*\*/.source, // 5: bold
  /__(?=\S)([\s\S]*?\S)__(?!\w)/.source, // 6: bold
  /\*(?=[^\s*])([\s\S]*?[^\s*])\*/.source, // 7: italic
  /(?<!\w)_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/.source, // 8: italic
  /(https?:\/\/[^\s<>()]*[^\s<>().,;:!?'"])/.source, // 9: a bare address
].join("|"));
const LINK_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);

/** The DocumentFragment showing `text`. */
export function render(text) {
  const fragment = document.createDocumentFragment();
  blocks(text.replace(/\r\n?/g, "\n").split("\n"), fragment);
  return fragment;
}

function blocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if ((match = FENCE.exec(line))) {
      const body = [];
      for (i++; i < lines.length && !lines[i].trimStart().startsWith(match[1]); i++) body.push(lines[i]);
      i++; // the closing fence (an answer still streaming may not have it yet)
      const code = element("code", body.join("\n"));
      if (match[2]) code.className = `language-${match[2]}`;
      parent.append(element("pre", code));
    } else if (!line.trim()) {
      i++;
    } else if ((match = HEADING.exec(line))) {
      // one level below the page's own headings
      parent.append(inline(element(`h${Math.min(match[1].length + 2, 6)}`), match[2]));
      i++;
    } else if (RULE.test(line)) {
      parent.append(element("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && (match = QUOTE.exec(lines[i])); i++) quoted.push(match[1]);
      const quote = element("blockquote");
      blocks(quoted, quote);
      parent.append(quote);
    } else if (ITEM.test(line)) {
      i = list(lines, i, parent);
    } else {
      const paragraph = [];
      for (; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i++) paragraph.push(lines[i].trim());
      const p = element("p");
      paragraph.forEach((text, n) => {
        if (n) p.append(element("br"));
        inline(p, text);
      });
      parent.append(p);
    }
  }
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

/** The list starting at lines[i] (items of one kind; an item's indented lines are its own blocks, so lists nest);
 * returns the index after it. */
function list(lines, i, parent) {
  const first = ITEM.exec(lines[i]);
  const ordered = first[3] !== undefined;
  const node = element(ordered ? "ol" : "ul");
  if (ordered && first[3] !== "1") node.start = Number(first[3]);
  while (i < lines.length) {
    const item = ITEM.exec(lines[i]);
    if (!item || (item[3] !== undefined) !== ordered) break;
    const indent = item[1].length + item[2].length + 1;
    const content = [item[4]];
    for (i++; i < lines.length; i++) {
      const line = lines[i];
      const blankThenMore = !line.trim() && i + 1 < lines.length && lines[i + 1].startsWith(" ".repeat(indent));
      if (line.startsWith(" ".repeat(indent)) || blankThenMore) content.push(line.slice(indent));
      else if (line.trim() && !startsBlock(line) && lines[i - 1].trim()) content.push(line.trim()); // lazy line
      else break;
    }
    const li = element("li");
    blocks(content, li);
    if (li.childNodes.length === 1 && li.firstChild.nodeName === "P") li.replaceChildren(...li.firstChild.childNodes);
    node.append(li);
    if (i < lines.length && !lines[i].trim() && i + 1 < lines.length && ITEM.test(lines[i + 1])) i++;
  }
  parent.append(node);
  return i;
}

/** Append `text`'s inline Markdown to `parent`; returns `parent`. */
function inline(parent, text) {
  let match;
  while (text && (match = INLINE.exec(text))) {
    if (match.index) parent.append(text.slice(0, match.index));
    const [whole, , code, label, href, bold1, bold2, italic1, italic2, address] = match;
    if (code !== undefined) {
      const padded = code.length > 2 && code.startsWith(" ") && code.endsWith(" ");
      parent.append(element("code", padded ? code.slice(1, -1) : code));
    } else if (label !== undefined) {
      parent.append(link(href, label) ?? whole);
    } else if (bold1 !== undefined || bold2 !== undefined) {
      parent.append(inline(element("strong"), bold1 ?? bold2));
    } else if (italic1 !== undefined || italic2 !== undefined) {
      parent.append(inline(element("em"), italic1 ?? italic2));
    } else {
      parent.append(link(address) ?? address);
    }
    text = text.slice(match.index + whole.length);
  }
  if (text) parent.append(text);
  return parent;
}

/** An <a> to `href` showing `label` as written, or null when `href` is not an absolute http, https or mailto URL. */
function link(href, label = href) {
  let url;
  try {
    url = new URL(href);
  } catch {
    return null;
  }
  if (!LINK_PROTOCOLS.has(url.protocol)) return null;
  const a = element("a");
  a.href = url.href;
  a.rel = "noopener noreferrer";
  a.target = "_blank";
  a.append(label);
  return a;
}

function element(name, child) {
  const node = document.createElement(name);
  if (child !== undefined) node.append(child);
  return node;
}
