// The search page: every value from the server or the data is put in the page as text
// (textContent), never as HTML; the API key lives in this page's memory only.
"use strict";
const $ = (id) => document.getElementById(id);
let picture = null; // the dropped or chosen picture, as a data URL
const encoders = {}; // index name -> the encoder model it was built with
const thumbnails = []; // blob URLs of the shown thumbnails, revoked on the next search

function headers(json) {
  const h = json ? { "content-type": "application/json" } : {};
  const key = $("key").value.trim();
  if (key) h.authorization = "Bearer " + key;
  return h;
}

async function call(path, body) {
  const init = body === undefined ? { headers: headers(false) }
    : { method: "POST", headers: headers(true), body: JSON.stringify(body) };
  const answer = await fetch(path, init);
  const data = await answer.json().catch(() => ({}));
  if (!answer.ok) {
    const e = data.error;
    throw new Error(`${answer.status}: ${typeof e === "string" ? e : (e && e.message) || answer.statusText}`);
  }
  return data;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

async function loadIndexes() {
  try {
    const listing = await call("/v1/models");
    const indexes = listing.models.filter((m) => m.task === "index");
    indexes.forEach((m) => { encoders[m.name] = (m.manifest.encoder || {}).name || "?"; });
    const select = $("index");
    select.replaceChildren(...indexes.map((m) => {
      const option = document.createElement("option");
      option.value = m.name;
      option.textContent = `${m.name} (version ${m.version})`;
      return option;
    }));
    showError(indexes.length ? "" : "No vector index is deployed here.");
  } catch (e) {
    showError(`Could not list the indexes (${e.message}). Type the API key if the cluster has one.`);
  }
}

function readPicture(file) {
  if (!file) return;
  const reader = new FileReader();
  reader.onload = () => {
    picture = reader.result;
    $("caption").value = "";
    $("drop").firstChild.textContent = `${file.name} `;
    search();
  };
  reader.readAsDataURL(file);
}

async function thumbnail(index, id, into) {
  try {
    const answer = await fetch(`/v1/models/${encodeURIComponent(index)}/thumbnails/${encodeURIComponent(id)}`,
      { headers: headers(false) });
    if (!answer.ok) return;
    const url = URL.createObjectURL(await answer.blob());
    thumbnails.push(url);
    into.src = url;
    into.hidden = false;
  } catch (e) { /* the item is shown without its picture */ }
}

function result(index, hit) {
  const item = document.createElement("li");
  const img = document.createElement("img");
  img.alt = "";
  img.hidden = true;
  const id = document.createElement("div");
  id.className = "id";
  id.textContent = String(hit.id);
  const score = document.createElement("div");
  score.className = "score";
  score.textContent = `score ${hit.score.toFixed(4)}`;
  const meta = document.createElement("div");
  meta.className = "meta";
  meta.textContent = Object.entries(hit.metadata || {}).map(([k, v]) => `${k}: ${v}`).join(" · ");
  item.append(img, id, score, meta);
  thumbnail(index, hit.id, img);
  return item;
}

async function search() {
  const index = $("index").value;
  const text = $("caption").value.trim();
  if (text) picture = null;
  if (!index || (!text && !picture)) {
    showError(index ? "Type a caption or drop a picture." : "Choose an index (is one deployed?).");
    return;
  }
  const query = text ? { text } : { image: picture };
  const top_k = Number($("top_k").value) || 10;
  showError("");
  $("status").textContent = "Searching...";
  thumbnails.splice(0).forEach((url) => URL.revokeObjectURL(url));
  $("results").replaceChildren();
  try {
    const answer = await call(`/v1/models/${encodeURIComponent(index)}:search`, { query, top_k });
    const hits = answer.results[0];
    $("results").replaceChildren(...hits.map((hit) => result(index, hit)));
    $("status").textContent = `${hits.length} results from ${answer.model} version ${answer.version}, ` +
      `encoder ${encoders[index]} version ${answer.encoder_version}`;
  } catch (e) {
    $("status").textContent = "";
    showError(e.message);
  }
}

$("search").addEventListener("submit", (event) => { event.preventDefault(); search(); });
$("key").addEventListener("change", loadIndexes);
$("picture").addEventListener("change", () => readPicture($("picture").files[0]));
const drop = $("drop");
drop.addEventListener("dragover", (event) => { event.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (event) => {
  event.preventDefault();
  drop.classList.remove("over");
  readPicture(event.dataTransfer.files[0]);
});
loadIndexes();
