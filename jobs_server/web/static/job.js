// One job: its details, its log following live (SSE, resumed by byte offset), a download,
// Stop and Delete behind a confirmation, the exit code and the message; its limits and what it
// used (peak memory, CPU time); with retries, its attempts, each one's use and part of the log
// a click away (their log offsets split the log); the jobs it depends on and those that depend
// on it, and its webhook deliveries.

import { ApiError, authHeaders, getJson, jobPath, request, sendJson } from "./api.js";
import {
  announce, confirmAction, cpuTotalSeconds, el, formatBytes, formatCpuSeconds, formatTime,
  replaceChildren, statusBadge,
} from "./dom.js";
import { anyPending, readDeliveries, renderDeliveries } from "./deliveries.js";
import {
  neverRanText, readDependencies, readDependents, renderDependencies, renderDependents,
} from "./dependencies.js";
import { watchJobs } from "./events.js";
import { followEventStream } from "./sse.js";

const TERMINAL = new Set(["SUCCEEDED", "FAILED", "STOPPED"]);
// A queued job's place and a retried job's attempts change with no event of their own: such a
// job is read again this often.
const QUIET_CHANGES_REFRESH_MS = 5000;
const ATTEMPT_COLUMNS = [
  "Attempt", "Started", "Ended", "Exit code", "Peak memory", "CPU user", "CPU system",
  "CPU throttled", "Log",
];

/** What a job's retry options say: "up to 2, on exit codes 3, 137". */
function retriesText(job) {
  if (!job.max_retries) return "none";
  const codes = job.retry_on_exit_codes;
  return `up to ${job.max_retries}, on ${codes ? `exit codes ${codes.join(", ")}` : "any non-zero exit code"}`;
}

/** What a job may use: "memory 1.0 GiB, 0.5 CPU cores, 64 processes"; "none". */
function limitsText(limits) {
  const parts = [];
  if (typeof limits?.memory_bytes === "number") {
    parts.push(`memory ${formatBytes(limits.memory_bytes)}`);
  }
  if (typeof limits?.cpu_cores === "number") {
    parts.push(`${limits.cpu_cores} CPU ${limits.cpu_cores === 1 ? "core" : "cores"}`);
  }
  if (typeof limits?.max_processes === "number") {
    parts.push(`${limits.max_processes} ${limits.max_processes === 1 ? "process" : "processes"}`);
  }
  return parts.length ? parts.join(", ") : "none";
}

/** CPU time, total first: "1.50 s (user 1.20 s, system 0.30 s)"; empty while unmeasured. */
function cpuTimeText(usage) {
  const total = cpuTotalSeconds(usage);
  if (total === null) return "";
  const part = (seconds) => formatCpuSeconds(seconds) || "unmeasured";
  return `${formatCpuSeconds(total)} (user ${part(usage.cpu_user_s)}, system ${part(usage.cpu_system_s)})`;
}

/** The text-log URL of attempt `index`: from its offset to the next attempt's (or the end);
 * null when it wrote nothing before the next began (there is nothing to ask for). */
function attemptLogPath(jobId, attempts, index) {
  const offset = attempts[index].log_offset;
  const next = attempts[index + 1];
  if (next && next.log_offset <= offset) return null;
  const limit = next ? `&limit=${next.log_offset - offset}` : "";
  return `${jobPath(jobId)}/logs?format=text&offset=${offset}${limit}`;
}

export function renderJob(main, jobId, { signal, onError }) {
  const heading = el("h1", {}, "Job ", el("code", {}, jobId));
  const details = el("dl", { class: "details", id: "job-details" });
  const stop = el("button", { type: "button", id: "stop-job", class: "danger" }, "Stop");
  const remove = el("button", { type: "button", id: "delete-job", class: "danger" }, "Delete");
  const download = el("a", {
    href: `${jobPath(jobId)}/logs?format=text`, download: `${jobId}.log`, id: "download-log",
  }, "Download log");
  const error = el("p", { class: "error", role: "alert", id: "job-error" });
  const log = el("pre", { id: "job-log", class: "log", tabindex: "0", "aria-label": "Log" });
  const logState = el("p", { id: "log-state", class: "log-state" }, "Following the log…");
  const attemptsSection = el("section", { id: "attempts", "aria-labelledby": "attempts-title", hidden: true });
  const attemptLogTitle = el("h3", { id: "attempt-log-title" });
  const attemptLog = el("pre", {
    id: "attempt-log", class: "log", tabindex: "0", "aria-labelledby": "attempt-log-title",
  });
  const attemptLogSection = el("section", { hidden: true }, attemptLogTitle, attemptLog);
  const neverRan = el("p", { id: "dependency-failure", class: "error" });
  const dependenciesSection = el("section", {
    id: "dependencies", "aria-labelledby": "dependencies-title", hidden: true,
  });
  const dependentsSection = el("section", {
    id: "dependents", "aria-labelledby": "dependents-title", hidden: true,
  });
  const deliveriesSection = el("section", {
    id: "deliveries", "aria-labelledby": "deliveries-title", hidden: true,
  });
  let job = null;
  let quietTimer = null;
  // What the page read of the jobs around this one: by id, each dependency's details (null:
  // deleted); the dependents; the deliveries (null: a server without them).
  let dependencyDetails = new Map();
  let relatedReads = 0; // an older read that answers late is not shown over a newer one
  // The job's status when its dependents were last shown: set only by the read that shows
  // them, since a read overtaken by another (a refresh, the log's end) shows nothing.
  let dependentsShownFor = null;
  let deliveriesTimer = null;
  signal.addEventListener("abort", () => {
    clearTimeout(quietTimer);
    clearTimeout(deliveriesTimer);
  });

  replaceChildren(main, heading, error, neverRan, details,
    el("div", { class: "actions" }, stop, remove, download),
    dependenciesSection, dependentsSection, attemptsSection, deliveriesSection, attemptLogSection,
    el("h2", {}, "Log"), logState, log);

  async function showAttemptLog(index, path) {
    try {
      const text = path === null ? "" : await (await request(path, { signal })).text();
      attemptLogTitle.textContent = `Log of attempt ${index + 1}`;
      attemptLog.textContent = text; // as text: output is shown, never run
      attemptLogSection.hidden = false;
      attemptLog.focus();
    } catch (failure) {
      if (!signal.aborted) error.textContent = failure.message;
    }
  }

  function renderAttempts() {
    const attempts = job.attempts ?? [];
    attemptsSection.hidden = !(job.max_retries > 0 || attempts.length > 1);
    if (attemptsSection.hidden) return;
    const rows = attempts.map((attempt, index) => {
      const path = attemptLogPath(jobId, attempts, index);
      const link = el("a", { href: path ?? "#" }, `Log of attempt ${index + 1}`);
      link.addEventListener("click", (event) => {
        event.preventDefault(); // shown here, with the key, not as a page of its own
        showAttemptLog(index, path);
      });
      return el("tr", { "data-attempt": index + 1 },
        el("td", {}, index + 1),
        el("td", {}, formatTime(attempt.start_time)),
        el("td", {}, formatTime(attempt.end_time)),
        el("td", {}, attempt.exit_code ?? ""),
        el("td", { "data-field": "peak-memory" }, formatBytes(attempt.peak_memory_bytes)),
        el("td", { "data-field": "cpu-user" }, formatCpuSeconds(attempt.cpu_user_s)),
        el("td", { "data-field": "cpu-system" }, formatCpuSeconds(attempt.cpu_system_s)),
        el("td", { "data-field": "cpu-throttled" }, formatCpuSeconds(attempt.cpu_throttled_s)),
        el("td", {}, link));
    });
    replaceChildren(attemptsSection,
      el("h2", { id: "attempts-title" }, "Attempts"),
      el("table", { class: "jobs attempts" },
        el("thead", {}, el("tr", {}, ATTEMPT_COLUMNS.map((name) => el("th", { scope: "col" }, name)))),
        el("tbody", {}, rows)));
  }

  function renderDetails() {
    const lastAttempt = job.attempts?.at(-1);
    const throttled = lastAttempt?.cpu_throttled_s;
    const rows = [
      ["Status", statusBadge(job.status)],
      ["Message", job.message ?? ""],
      ["Exit code", job.driver_exit_code ?? ""],
      ["Priority", job.priority ?? 0],
      ["Retries", retriesText(job)],
      ["Entrypoint", el("code", {}, job.entrypoint)],
      ["Submission id", job.submission_id],
      ["Started", formatTime(job.start_time)],
      ["Ended", formatTime(job.end_time)],
      ["Limits", limitsText(job.limits)],
      ["Peak memory", formatBytes(job.peak_memory_bytes)],
      ["CPU time", cpuTimeText(job)],
      // Only a CPU limit holds a job back: nothing to say without one.
      typeof throttled === "number" ? ["CPU throttled", formatCpuSeconds(throttled)] : null,
      ["Metadata", Object.entries(job.metadata ?? {}).map(([key, value]) =>
        el("span", { class: "tag" }, `${key}=${value}`))],
      ["Runtime env", el("code", {}, JSON.stringify(job.runtime_env ?? {}))],
    ];
    replaceChildren(details, rows.filter((row) => row !== null).flatMap(([name, value]) => [
      el("dt", {}, name),
      el("dd", { "data-field": name.toLowerCase().replaceAll(" ", "-") }, value),
    ]));
    const terminal = TERMINAL.has(job.status);
    stop.disabled = terminal;
    remove.disabled = !terminal;
    renderAttempts();
    renderDependencies(dependenciesSection, job, dependencyDetails);
    neverRan.textContent = neverRanText(job, dependencyDetails) ?? "";
    clearTimeout(quietTimer);
    const changesQuietly = job.status === "PENDING" || (!terminal && job.max_retries > 0);
    if (changesQuietly && !signal.aborted) quietTimer = setTimeout(refresh, QUIET_CHANGES_REFRESH_MS);
  }

  async function refresh() {
    try {
      const previous = job?.status;
      job = await getJson(jobPath(jobId), { signal });
      renderDetails();
      if (previous && previous !== job.status) announce(`Job ${jobId} is ${job.status}`);
      refreshRelated();
    } catch (failure) {
      if (!signal.aborted) onError(failure);
    }
  }

  // The jobs around this one and its deliveries change without an event of its own: read at
  // each refresh and event of the job; the dependents only when its status changed (they can
  // be many pages away), the deliveries again while one is pending.
  async function refreshRelated() {
    const read = ++relatedReads;
    const status = job.status;
    const lookForDependents = dependentsShownFor !== status;
    clearTimeout(deliveriesTimer);
    try {
      const [dependencies, dependents, deliveries] = await Promise.all([
        readDependencies(job, signal),
        lookForDependents ? readDependents(job, signal) : null,
        readDeliveries(jobId, signal),
      ]);
      if (read !== relatedReads || signal.aborted) return;
      dependencyDetails = dependencies;
      renderDetails();
      if (dependents) {
        renderDependents(dependentsSection, dependents);
        dependentsShownFor = status;
      }
      renderDeliveries(deliveriesSection, deliveries);
      if (anyPending(deliveries)) {
        deliveriesTimer = setTimeout(refreshRelated, QUIET_CHANGES_REFRESH_MS);
      }
    } catch (failure) {
      if (signal.aborted) return;
      if (failure instanceof ApiError && failure.isAuthError) onError(failure);
      else error.textContent = failure.message;
    }
  }

  async function followLog() {
    await followEventStream({
      signal,
      open: (lastOffset) => request(`${jobPath(jobId)}/logs/stream`, {
        signal,
        headers: { Accept: "text/event-stream", ...(lastOffset ? { "Last-Event-ID": lastOffset } : {}) },
      }),
      onEvent: (event) => {
        if (event.type === "end") {
          logState.textContent = "The job has ended; this is its whole log.";
          refresh();
          return true;
        }
        log.append(JSON.parse(event.data)); // a text node: output is shown, never run
        if (log.dataset.follow !== "off") log.scrollTop = log.scrollHeight;
        return false;
      },
    });
  }

  // Stop following the bottom while the reader scrolls up; follow again at the bottom.
  log.addEventListener("scroll", () => {
    const atBottom = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
    log.dataset.follow = atBottom ? "on" : "off";
  });

  stop.addEventListener("click", async () => {
    const confirmed = await confirmAction({
      title: "Stop this job?",
      text: `Job ${jobId} gets SIGTERM, then SIGKILL after the grace period.`,
      confirmLabel: "Stop job",
    });
    if (!confirmed) return;
    try {
      const { stopped } = await sendJson("POST", `${jobPath(jobId)}/stop`);
      announce(stopped ? `Stopping job ${jobId}` : `Job ${jobId} had already ended`);
      await refresh();
    } catch (failure) {
      error.textContent = failure.message;
    }
  });

  remove.addEventListener("click", async () => {
    const confirmed = await confirmAction({
      title: "Delete this job?",
      text: `Job ${jobId} and its log are deleted for good.`,
      confirmLabel: "Delete job",
    });
    if (!confirmed) return;
    try {
      await sendJson("DELETE", jobPath(jobId));
      announce(`Deleted job ${jobId}`);
      location.hash = "#/";
    } catch (failure) {
      error.textContent = failure.message;
    }
  });

  // A link cannot carry the key: fetch the log with it and hand the browser the bytes.
  download.addEventListener("click", async (event) => {
    if (!authHeaders().Authorization) return; // no key: the plain link works
    event.preventDefault();
    try {
      const blob = await (await request(download.getAttribute("href"))).blob();
      const url = URL.createObjectURL(blob);
      const link = el("a", { href: url, download: `${jobId}.log`, hidden: true });
      document.body.append(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(url), 0);
    } catch (failure) {
      error.textContent = failure.message;
    }
  });

  refresh()
    .then(() => {
      if (!job) return;
      followLog().catch((failure) => { if (!signal.aborted) onError(failure); });
      return watchJobs({
        submissionId: jobId,
        signal,
        onChange: (event) => {
          if (event.type === "deleted") {
            error.textContent = "This job was deleted.";
          } else if (event.job) {
            job = event.job;
            renderDetails();
            refreshRelated();
          } else if (!TERMINAL.has(job.status) || event.type === "reset") {
            refresh();
          }
        },
      });
    })
    .catch((failure) => { if (!signal.aborted) onError(failure); });
}
