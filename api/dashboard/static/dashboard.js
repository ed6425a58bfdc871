// Flywheel dashboard: small enhancements only; every page works without this file.
"use strict";
document.addEventListener("DOMContentLoaded", function () {
  // The status filter applies as soon as it changes.
  document.querySelectorAll("select[data-autosubmit]").forEach(function (select) {
    select.addEventListener("change", function () { select.form.submit(); });
  });
  // A disabled button's form never submits (Enter in a field included).
  document.querySelectorAll("form.action").forEach(function (form) {
    form.addEventListener("submit", function (event) {
      var button = form.querySelector("button[type=submit]");
      if (button && button.disabled) { event.preventDefault(); }
    });
  });
  // The fleet page reloads itself every few heartbeats.
  var every = Number(document.body.dataset.refresh || 0);
  if (every > 0) { setTimeout(function () { window.location.reload(); }, every * 1000); }
});
