// The submit form: entrypoint, id, env_vars, metadata, a working_dir URL, resources, and the
// queue's priority and retries.

import { sendJson } from "./api.js";
import { el, replaceChildren } from "./dom.js";

/** `KEY=VALUE` lines as an object; blank lines are skipped. Throws on a line without `=`. */
export function parsePairs(text, what) {
  const pairs = {};
  for (const [index, raw] of text.split("\n").entries()) {
    const line = raw.trim();
    if (!line) continue;
    const equals = line.indexOf("=");
    if (equals <= 0) throw new Error(`${what}, line ${index + 1}: expected KEY=VALUE, got "${line}"`);
    pairs[line.slice(0, equals).trim()] = line.slice(equals + 1);
  }
  return pairs;
}

function field(id, label, control, hint) {
  const hintId = hint ? `${id}-hint` : undefined;
  if (hintId) control.setAttribute("aria-describedby", hintId);
  return el("div", { class: "field" },
    el("label", { for: id }, label), control,
    hint ? el("small", { id: hintId }, hint) : null);
}

function number(value, what, { integer = false } = {}) {
  if (value.trim() === "") return undefined;
  const parsed = Number(value);
  if (!Number.isFinite(parsed) || parsed < 0 || (integer && !Number.isInteger(parsed))) {
    throw new Error(`${what}: expected ${integer ? "a whole number" : "a number"} ≥ 0`);
  }
  return parsed;
}

/** A whole number as typed; anything else goes to the server as typed, for its own message
 * (it is the one that checks the bounds, and says them). */
function integerOrText(value) {
  const text = value.trim();
  if (text === "") return undefined;
  return /^[+-]?\d+$/.test(text) ? Number(text) : text;
}

/** Exit codes separated by commas or spaces; each one checked by the server. */
function exitCodes(value) {
  const codes = value.split(/[\s,]+/).filter(Boolean).map(integerOrText);
  return codes.length ? codes : undefined;
}

export function renderSubmitForm(main) {
  const control = (tag, attributes) => el(tag, { name: attributes.id, ...attributes });
  const entrypoint = control("textarea", { id: "entrypoint", rows: 3, required: true, spellcheck: "false" });
  const submissionId = control("input", { id: "submission-id", autocomplete: "off" });
  const envVars = control("textarea", { id: "env-vars", rows: 3, spellcheck: "false" });
  const metadata = control("textarea", { id: "metadata", rows: 3, spellcheck: "false" });
  const workingDir = control("input", { id: "working-dir", type: "url", autocomplete: "off" });
  const cpus = control("input", { id: "num-cpus", inputmode: "decimal" });
  const gpus = control("input", { id: "num-gpus", inputmode: "decimal" });
  const memory = control("input", { id: "memory", inputmode: "numeric" });
  const resources = control("textarea", { id: "resources", rows: 2, spellcheck: "false" });
  const priority = control("input", { id: "priority", inputmode: "numeric", autocomplete: "off" });
  const maxRetries = control("input", { id: "max-retries", inputmode: "numeric", autocomplete: "off" });
  const retryCodes = control("input", { id: "retry-on-exit-codes", autocomplete: "off" });
  const error = el("p", { class: "error", role: "alert", id: "submit-error" });
  const submitButton = el("button", { type: "submit" }, "Submit job");

  const form = el("form", { id: "submit-form", novalidate: true },
    field("entrypoint", "Entrypoint (shell command)", entrypoint),
    field("submission-id", "Submission id (optional)", submissionId, "Leave empty for a generated id."),
    field("env-vars", "Environment variables", envVars, "One KEY=VALUE per line."),
    field("metadata", "Metadata", metadata, "One key=value per line."),
    field("working-dir", "working_dir URL", workingDir, "A package URL, e.g. s3://bucket/pkg.zip or https://…/pkg.zip."),
    el("fieldset", {}, el("legend", {}, "Resources"),
      field("num-cpus", "CPUs", cpus),
      field("num-gpus", "GPUs", gpus),
      field("memory", "Memory (bytes)", memory),
      field("resources", "Custom resources", resources, "One name=amount per line.")),
    el("fieldset", {}, el("legend", {}, "Queue and retries"),
      field("priority", "Priority", priority, "A whole number; higher runs first among its tenant's queued jobs. Default 0."),
      field("max-retries", "Max retries", maxRetries, "Failed attempts retried after the first. Default 0."),
      field("retry-on-exit-codes", "Retry on exit codes", retryCodes,
        "Separated by commas, e.g. 1, 137. Empty: any non-zero code is retried.")),
    error, submitButton);

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.textContent = "";
    let body;
    try {
      body = { entrypoint: entrypoint.value };
      if (!body.entrypoint.trim()) throw new Error("Entrypoint: enter a command to run.");
      if (submissionId.value.trim()) body.submission_id = submissionId.value.trim();
      const runtimeEnv = {};
      const env = parsePairs(envVars.value, "Environment variables");
      if (Object.keys(env).length) runtimeEnv.env_vars = env;
      if (workingDir.value.trim()) runtimeEnv.working_dir = workingDir.value.trim();
      if (Object.keys(runtimeEnv).length) body.runtime_env = runtimeEnv;
      const meta = parsePairs(metadata.value, "Metadata");
      if (Object.keys(meta).length) body.metadata = meta;
      body.entrypoint_num_cpus = number(cpus.value, "CPUs");
      body.entrypoint_num_gpus = number(gpus.value, "GPUs");
      body.entrypoint_memory = number(memory.value, "Memory", { integer: true });
      const custom = Object.fromEntries(Object.entries(parsePairs(resources.value, "Custom resources"))
        .map(([name, amount]) => [name, number(amount, `Custom resource ${name}`)]));
      if (Object.keys(custom).length) body.entrypoint_resources = custom;
      body.priority = integerOrText(priority.value);
      body.max_retries = integerOrText(maxRetries.value);
      body.retry_on_exit_codes = exitCodes(retryCodes.value);
    } catch (failure) {
      error.textContent = failure.message;
      return;
    }
    submitButton.disabled = true;
    try {
      const { submission_id: id } = await sendJson("POST", "/api/jobs/", body);
      location.hash = `#/jobs/${encodeURIComponent(id)}`;
    } catch (failure) {
      error.textContent = failure.message; // the server's message, as text
      submitButton.disabled = false;
    }
  });

  replaceChildren(main, el("h1", {}, "Submit a job"), form);
  entrypoint.focus();
}
