// Render the math that pymdownx.arithmatex (generic mode) leaves as \( \) and \[ \] in
// .arithmatex elements, with the KaTeX shipped in javascripts/katex (no CDN: the site reads
// offline). document$ is Material's page observable: instant navigation renders each page.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [
      { left: "\\(", right: "\\)", display: false },
      { left: "\\[", right: "\\]", display: true },
    ],
    throwOnError: false,
  });
});
