// sandstream console: follows the pages' live feeds (server-sent events) and puts the parts the
// server renders in place. Without this script the pages are complete, only not live.
(function () {
  "use strict";

  var status = document.getElementById("live-status");

  function say(state, text) {
    if (status) {
      status.dataset.state = state;
      status.textContent = text;
    }
    document.documentElement.dataset.live = state;
  }

  function replace(id, html) {
    var el = document.getElementById(id);
    if (el && el.innerHTML !== html) {
      el.innerHTML = html;
    }
  }

  function follow(url, handlers) {
    say("connecting", "Connecting…");
    var source = new EventSource(url);
    source.onopen = function () { say("open", "Live"); };
    source.onerror = function () {
      if (source.readyState === EventSource.CLOSED) {
        say("closed", "Not live: reload the page (or sign in again)");
      } else {
        say("connecting", "Reconnecting…");
      }
    };
    source.addEventListener("signed-out", function () {
      source.close();
      say("closed", "Not live: the session ended, sign in again");
    });
    Object.keys(handlers).forEach(function (event) {
      source.addEventListener(event, function (e) { handlers[event](JSON.parse(e.data)); });
    });
  }

  var fleet = document.querySelector("[data-live-fleet]");
  if (fleet) {
    follow(fleet.dataset.liveFleet, {
      fleet: function (d) {  // the parts that changed
        if (d.counts !== undefined) { replace("counts", d.counts); }
        if (d.attention !== undefined) { replace("attention", d.attention); }
        if (d.table !== undefined) { replace("sandboxes", d.table); }
      }
    });
  }

  var sandbox = document.querySelector("[data-live-sandbox]");
  if (sandbox) {
    var shown = sandbox.dataset.version;
    follow(sandbox.dataset.liveSandbox, {
      row: function (d) {
        replace("row", d.html);
        var stale = document.getElementById("stale");
        if (stale && String(d.version) !== shown) {
          stale.querySelector(".now-version").textContent = d.version;
          stale.hidden = false;
        }
      },
      inputs: function (d) {
        var body = document.getElementById("inputs");
        if (body) {
          body.insertAdjacentHTML("beforeend", d.html);
        }
      }
    });
  }
})();
