// tpuray dashboard: refreshes what the page shows, nothing more (DASH-1). Every few
// seconds it fetches the page it is on and swaps in the new <main>; it pauses while the
// tab is hidden or when the user says so. The page is complete without this script.
(function () {
  "use strict";
  var every = parseInt(document.body.getAttribute("data-refresh") || "0", 10);
  var box = document.getElementById("refresh");
  if (!every || !box || !window.fetch || !window.DOMParser) {
    return;
  }
  var button = document.getElementById("refresh-toggle");
  var status = document.getElementById("refresh-status");
  var paused = false;
  var busy = false;
  box.hidden = false;
  button.addEventListener("click", function () {
    paused = !paused;
    button.textContent = paused ? "resume" : "pause";
  });
  function say(text) {
    status.textContent = text;
  }
  function openDetails(root) {
    var open = [];
    root.querySelectorAll("details[open]").forEach(function (d, i) {
      open.push(d.querySelector("summary") ? d.querySelector("summary").textContent : String(i));
    });
    return open;
  }
  function tick() {
    if (paused || busy || document.hidden) {
      return;
    }
    busy = true;
    fetch(window.location.href, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) {
        if (!r.ok) {
          throw new Error("HTTP " + r.status);
        }
        return r.text();
      })
      .then(function (html) {
        var doc = new DOMParser().parseFromString(html, "text/html");
        var fresh = doc.querySelector("main");
        var old = document.querySelector("main");
        if (fresh && old) {
          var keep = openDetails(old);
          fresh.querySelectorAll("details").forEach(function (d) {
            var s = d.querySelector("summary");
            if (s && keep.indexOf(s.textContent) >= 0) {
              d.open = true;
            }
          });
          old.replaceWith(fresh);
        }
        say("updated " + new Date().toLocaleTimeString());
      })
      .catch(function (e) {
        say("not updated: " + e.message);
      })
      .then(function () {
        busy = false;
      });
  }
  window.setInterval(tick, every * 1000);
})();
