// A job's place in a chain (issue 36): the jobs it depends on, each with its condition, its
// status and whether it is met; the jobs that depend on it, found among the jobs submitted after
// it (a dependency must exist when its dependent is submitted), with the list API's own query;
// and, for a job that can never run, which dependency is why.

import { getJson, nextAfter, request } from "./api.js";
import { el, replaceChildren, statusBadge } from "./dom.js";

// Dependents are looked for in at most this many pages of the jobs submitted after the job.
const DEPENDENTS_PAGE_SIZE = 1000;
const DEPENDENTS_MAX_PAGES = 10;
const TERMINAL = new Set(["SUCCEEDED", "FAILED", "STOPPED"]);
const NEVER_SATISFIED = "DEPENDENCY_NEVER_SATISFIED";

/** Whether a job with `status` meets `condition` (the server's DependencyCondition.holds). */
export function conditionHolds(condition, status) {
  if (!TERMINAL.has(status)) return false;
  if (condition === "succeeded") return status === "SUCCEEDED";
  if (condition === "failed") return status !== "SUCCEEDED";
  return true; // ended
}

/** Whether it holds or may yet (`status` null: the job was deleted). */
export function canStillHold(condition, status) {
  return status !== null && (!TERMINAL.has(status) || conditionHolds(condition, status));
}

// What a page learnt of a job's dependencies once each had ended or was deleted, by the job's
// run (id and submit time), for the last few jobs shown: a terminal status is final, so they
// are not read again at each refresh of a job that waits.
const DECIDED_KEPT = 32;
const decidedDependencies = new Map();

function isDecided(details) {
  return details === null || TERMINAL.has(details.status);
}

/** The details of each job `job` depends on, by id (null: deleted), read in one request (the
 * list by ids), or not at all once every one has ended. */
export async function readDependencies(job, signal) {
  const ids = (job.depends_on ?? []).map((dependency) => dependency.submission_id);
  if (ids.length === 0) return new Map();
  const run = `${job.submission_id} ${job.start_time}`;
  const known = decidedDependencies.get(run);
  if (known) return known;
  const query = new URLSearchParams({ submission_id: ids.join(",") });
  const listed = await getJson(`/api/jobs/?${query}`, { signal });
  const found = new Map(listed.map((other) => [other.submission_id, other]));
  const details = new Map(ids.map((id) => [id, found.get(id) ?? null]));
  if ([...details.values()].every(isDecided)) {
    decidedDependencies.set(run, details);
    if (decidedDependencies.size > DECIDED_KEPT) {
      decidedDependencies.delete(decidedDependencies.keys().next().value);
    }
  }
  return details;
}

/** The jobs that depend on `job` ({job, condition}, in submission order), and whether every
 * job submitted after it was looked at (`complete`). */
export async function readDependents(job, signal) {
  const query = new URLSearchParams({ limit: String(DEPENDENTS_PAGE_SIZE) });
  // The same millisecond too: submitted_after is strict.
  if (job.start_time) query.set("submitted_after", String(job.start_time - 1));
  const dependents = [];
  let after = null;
  for (let page = 0; page < DEPENDENTS_MAX_PAGES; page += 1) {
    if (after) query.set("after", after);
    const response = await request(`/api/jobs/?${query}`, { signal });
    for (const other of await response.json()) {
      const on = (other.depends_on ?? []).find((d) => d.submission_id === job.submission_id);
      if (on) dependents.push({ job: other, condition: on.condition });
    }
    after = nextAfter(response);
    if (after === null) break;
  }
  return { dependents, complete: after === null };
}

/** The dependency a job ended DEPENDENCY_NEVER_SATISFIED for, by the job's own word (its
 * message begins with it: "prep ended FAILED; ...", "prep was deleted; ..."): {id, outcome};
 * null for another job. The terminal client reads it the same way (client/output.py). */
export function neverRanFor(job) {
  if (job.error_type !== NEVER_SATISFIED) return null;
  const message = job.message ?? "";
  for (const { submission_id: id } of job.depends_on ?? []) {
    if (message.startsWith(`${id} ended `) || message.startsWith(`${id} was deleted;`)) {
      return { id, outcome: message.slice(id.length + 1).split(";")[0] };
    }
  }
  return null;
}

/** Whether a dependency can no longer be met: the one the job never ran for, or one whose
 * details (null: deleted) read here say so; the server's `met` first: a job deleted after its
 * condition held stays met. */
function neverMet(job, dependency, details) {
  if (dependency.met === true) return false;
  if (neverRanFor(job)?.id === dependency.submission_id) return true;
  if (details === undefined) return false;
  return !canStillHold(dependency.condition, details?.status ?? null);
}

/** Whether a dependency is met, as the terminal client says it too: "met" (the server's
 * word), "never" once it cannot be, "not yet" while it may, "not known". */
function metText(job, dependency, details) {
  if (dependency.met === true) return "met";
  if (neverMet(job, dependency, details)) return "never";
  if (dependency.met === false) return "not yet";
  return "not known";
}

function jobLink(jobId) {
  return el("a", { href: `#/jobs/${encodeURIComponent(jobId)}` }, jobId);
}

function statusCell(details) {
  if (details === undefined) return ""; // not read yet
  return details === null ? "deleted" : statusBadge(details.status);
}

/** Why a job ended DEPENDENCY_NEVER_SATISFIED, naming the dependency; null for another job. */
export function neverRanText(job, detailsById) {
  if (job.error_type !== NEVER_SATISFIED) return null;
  const named = neverRanFor(job);
  for (const dependency of job.depends_on ?? []) {
    const id = dependency.submission_id;
    if (named?.id === id) {
      return `This job never ran: it was to run after ${id} ${dependency.condition}, but ${id} ${named.outcome}.`;
    }
  }
  for (const dependency of job.depends_on ?? []) {
    const id = dependency.submission_id;
    const details = detailsById.get(id);
    if (!neverMet(job, dependency, details)) continue;
    const outcome = details === null ? "was deleted" : `ended ${details.status}`;
    return `This job never ran: it was to run after ${id} ${dependency.condition}, but ${id} ${outcome}.`;
  }
  return "This job never ran: a job it depends on can no longer meet its condition.";
}

/** The "Depends on" section: hidden for a job that waits for none. */
export function renderDependencies(section, job, detailsById) {
  const dependencies = job.depends_on ?? [];
  section.hidden = dependencies.length === 0;
  if (section.hidden) return;
  const met = dependencies.filter((dependency) => dependency.met === true).length;
  const rows = dependencies.map((dependency) => {
    const details = detailsById.get(dependency.submission_id);
    return el("tr", { "data-job-id": dependency.submission_id },
      el("td", {}, jobLink(dependency.submission_id)),
      el("td", { "data-field": "condition" }, dependency.condition),
      el("td", { "data-field": "status" }, statusCell(details)),
      el("td", { "data-field": "met" }, metText(job, dependency, details)));
  });
  replaceChildren(section,
    el("h2", { id: "dependencies-title" }, "Depends on"),
    el("p", { id: "dependencies-summary" }, `${met} of ${dependencies.length} met`),
    el("table", { class: "jobs" },
      el("thead", {}, el("tr", {},
        ["Job", "Condition", "Status", "Met"].map((name) => el("th", { scope: "col" }, name)))),
      el("tbody", {}, rows)));
}

/** The "Depended on by" section: hidden while none is known. */
export function renderDependents(section, { dependents, complete }) {
  section.hidden = dependents.length === 0 && complete;
  if (section.hidden) return;
  const rows = dependents.map(({ job, condition }) =>
    el("tr", { "data-job-id": job.submission_id },
      el("td", {}, jobLink(job.submission_id)),
      el("td", { "data-field": "condition" }, condition),
      el("td", { "data-field": "status" }, statusBadge(job.status))));
  const scope = complete ? null : el("p", { class: "empty" },
    `Looked for among the first ${DEPENDENTS_PAGE_SIZE * DEPENDENTS_MAX_PAGES} jobs submitted after this one.`);
  replaceChildren(section,
    el("h2", { id: "dependents-title" }, "Depended on by"),
    scope,
    el("table", { class: "jobs" },
      el("thead", {}, el("tr", {},
        ["Job", "Condition", "Status"].map((name) => el("th", { scope: "col" }, name)))),
      el("tbody", {}, rows)));
}
