// The page's router: #/ (the job list), #/jobs/<id> (a job), #/submit (the form); and the key
// prompt, shown before anything else when the server needs a key, and again if it rejects it.

import { ApiError, authRequired, forgetKey, storedKey, storeKey } from "./api.js";
import { el, replaceChildren } from "./dom.js";
import { renderJob } from "./job.js";
import { renderJobList } from "./list.js";
import { renderSubmitForm } from "./submit.js";

const main = document.getElementById("main");
const keyForm = document.getElementById("key-form");
const keyInput = document.getElementById("key-input");
const keyError = document.getElementById("key-error");
const forgetButton = document.getElementById("forget-key");
let current = null; // the AbortController of the view on screen: its streams end with it

function askForKey(message = "") {
  current?.abort();
  main.hidden = true;
  keyForm.hidden = false;
  keyError.textContent = message;
  keyInput.value = "";
  keyInput.focus();
}

function onError(error) {
  if (error instanceof ApiError && error.isAuthError) {
    forgetKey();
    askForKey(error.status === 403 ? "The server rejected that key." : "");
    return;
  }
  replaceChildren(main, el("h1", {}, "Something went wrong"),
    el("p", { class: "error", role: "alert" }, error.message));
}

function route() {
  current?.abort();
  current = new AbortController();
  // A question about the view left behind is no longer asked (it answers "no").
  const confirmDialog = document.getElementById("confirm-dialog");
  if (confirmDialog.open) confirmDialog.close();
  if (authRequired() && !storedKey()) {
    askForKey();
    return;
  }
  keyForm.hidden = true;
  main.hidden = false;
  forgetButton.hidden = !storedKey();
  const options = { signal: current.signal, onError };
  const hash = location.hash || "#/";
  const jobMatch = hash.match(/^#\/jobs\/(.+)$/);
  if (jobMatch) {
    renderJob(main, decodeURIComponent(jobMatch[1]), options);
  } else if (hash === "#/submit") {
    renderSubmitForm(main);
  } else {
    renderJobList(main, { ...options, params: new URLSearchParams(hash.split("?")[1] ?? "") });
  }
  document.querySelectorAll("nav a").forEach((link) => {
    if (link.getAttribute("href") === hash.split("?")[0]) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  });
}

keyForm.addEventListener("submit", (event) => {
  event.preventDefault();
  const key = keyInput.value.trim();
  if (!key) return;
  storeKey(key);
  route();
});

forgetButton.addEventListener("click", () => {
  forgetKey();
  route();
});

window.addEventListener("hashchange", route);
route();
