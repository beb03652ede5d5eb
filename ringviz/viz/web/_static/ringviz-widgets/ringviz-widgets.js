// Loaded after require.js and before embed-amd.js (order set by nb_ipywidgets_js in _config.yml).
// Points RequireJS at the anywidget module served beside this file, so the ipywidgets HTML
// manager loads it from the book instead of falling back to a CDN.
(function () {
  var here = document.currentScript.src.replace(/[^/]*$/, "");
  require.config({ paths: { anywidget: here + "anywidget/index" } });
})();
