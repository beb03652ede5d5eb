// Loaded after require.js and before embed-amd.js (order set by nb_ipywidgets_js in _config.yml).
// Points RequireJS at the anywidget module served beside this file, so the ipywidgets HTML
// manager loads it from the book instead of falling back to a CDN. The manager's bundled CSS
// (Font Awesome 5) asks for its fonts beside the URL RequireJS gives each of its two modules;
// mapping both into html-manager/ makes them the files served there, not page-relative misses.
(function () {
  var here = document.currentScript.src.replace(/[^/]*$/, "");
  require.config({ paths: {
    anywidget: here + "anywidget/index",
    "@jupyter-widgets/html-manager": here + "html-manager/index",
    "@jupyter-widgets/html-manager/dist": here + "html-manager",
  } });
})();
