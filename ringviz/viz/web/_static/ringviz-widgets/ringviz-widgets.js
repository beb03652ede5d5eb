// Loaded after require.js and before embed-amd.js (order set by nb_ipywidgets_js in _config.yml).
// Points RequireJS at the anywidget module served beside this file, so the ipywidgets HTML
// manager loads it from the book instead of falling back to a CDN. The manager's bundled CSS
// (Font Awesome 5) asks for its fonts beside the URL RequireJS gives its module; mapping that
// module's folder here makes them the files served in html-manager/, not a page-relative miss.
(function () {
  var here = document.currentScript.src.replace(/[^/]*$/, "");
  require.config({ paths: {
    anywidget: here + "anywidget/index",
    "@jupyter-widgets/html-manager/dist": here + "html-manager",
  } });
})();
