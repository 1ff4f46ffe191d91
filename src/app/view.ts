/**
 * Renders a NodeStatus into the page's static markup (index.html). Writes
 * only what changed, so screen readers announce a state change once and not
 * on every poll.
 */
import type { NodeStatus } from '../host/browser/engine.ts';
import { formatBytes, formatCount, percent, sparklinePoints } from './format.ts';

const LABELS: Record<NodeStatus['state'], string> = {
  idle: 'Not started',
  connecting: 'Connecting',
  downloading: 'Downloading',
  loading: 'Loading',
  serving: 'Serving',
  paused: 'Paused',
  error: 'Error',
};

export interface ViewRoot {
  getElementById(id: string): HTMLElement | null;
}

function el<T extends HTMLElement = HTMLElement>(root: ViewRoot, id: string): T {
  const e = root.getElementById(id);
  if (!e) throw new Error(`index.html lacks #${id}`);
  return e as T;
}

function setText(e: HTMLElement, text: string): void {
  if (e.textContent !== text) e.textContent = text;
}

function setHidden(e: HTMLElement, hidden: boolean): void {
  if (e.hidden !== hidden) e.hidden = hidden;
}

/** The headline for a status: "Downloading 42 %", "Serving layers 0–6", the error's message. */
export function headline(s: NodeStatus): string {
  switch (s.state) {
    case 'downloading':
      return s.download ? `Downloading ${percent(s.download.loadedBytes, s.download.totalBytes)} %` : 'Downloading';
    case 'serving':
      return s.model ? `Serving layers ${s.model.startLayer}–${s.model.endLayer - 1}` : 'Serving';
    case 'error':
      return `Error: ${s.error?.code ?? 'unknown'}`;
    default:
      return LABELS[s.state];
  }
}

export function renderStatus(root: ViewRoot, s: NodeStatus): void {
  const badge = el(root, 'state');
  if (badge.dataset.state !== s.state) badge.dataset.state = s.state;
  const label = s.state === 'downloading' && s.download ? `Downloading ${percent(s.download.loadedBytes, s.download.totalBytes)} %` : LABELS[s.state];
  setText(badge, label);
  setText(el(root, 'headline'), headline(s));

  const reason = el(root, 'reason');
  const action = el(root, 'action');
  if (s.state === 'error' && s.error) {
    setText(reason, s.error.message);
    setText(action, s.error.action);
    setHidden(action, false);
  } else {
    setHidden(action, true);
    const text =
      s.state === 'serving' ? 'Answering requests through the relay. Keep this tab open.'
      : s.state === 'paused' ? pausedText(s)
      : s.state === 'downloading' ? 'Fetching only the layers this node holds; a reload resumes where it stopped.'
      : s.state === 'loading' ? 'Checking stored layers and preparing the model.'
      : s.state === 'connecting' ? 'Choosing a backend and reaching the relay.'
      : 'Keep this tab open to run part of a language model for others.';
    setText(reason, text);
  }
  setHidden(el(root, 'retry'), !(s.state === 'error' && s.error?.retryable !== false));

  const dl = el(root, 'download');
  setHidden(dl, s.state !== 'downloading' || !s.download);
  if (s.download) {
    const bar = el<HTMLProgressElement>(root, 'download-bar');
    const pct = percent(s.download.loadedBytes, s.download.totalBytes);
    if (bar.value !== pct) bar.value = pct;
    setText(el(root, 'download-label'), `${formatBytes(s.download.loadedBytes)} of ${formatBytes(s.download.totalBytes)}`);
  }

  const pause = el<HTMLButtonElement>(root, 'pause');
  const canToggle = s.state === 'serving' || s.state === 'paused';
  if (pause.disabled === canToggle) pause.disabled = !canToggle;
  const paused = s.donor.paused;
  if (pause.getAttribute('aria-pressed') !== String(paused)) pause.setAttribute('aria-pressed', String(paused));
  setText(pause, pauseLabel(s));

  const g = s.contribution;
  setText(el(root, 'given-tokens'), formatCount(g.tokensServed));
  setText(el(root, 'given-hours'), formatDuration(g.servingMs));
  setText(el(root, 'given-layers'), String(g.layersHeld));
  setText(el(root, 'given-since'), g.since !== undefined ? `since ${new Date(g.since).toLocaleDateString()}` : '');
  const duty = el<HTMLInputElement>(root, 'duty');
  const dutyPct = String(Math.round(s.donor.dutyCycle * 100));
  if (root.getElementById('duty') !== (globalThis.document?.activeElement ?? null) && duty.value !== dutyPct) duty.value = dutyPct;
  setText(el(root, 'duty-value'), `${dutyPct} %`);
  const charging = el<HTMLInputElement>(root, 'charging-only');
  if (charging.checked !== s.donor.chargingOnly) charging.checked = s.donor.chargingOnly;
  setText(el(root, 'power'), powerText(s));
  const keep = el<HTMLInputElement>(root, 'keep-shard');
  if (keep.checked !== s.donor.keepShard) keep.checked = s.donor.keepShard;

  if (s.model) {
    setText(el(root, 'layers'), `${s.model.startLayer}–${s.model.endLayer - 1} of ${s.model.numLayers}`);
    setText(el(root, 'model'), `${s.model.name}${s.model.holdsHead ? ' · LM head' : ''}`);
  }
  setText(el(root, 'stored'), s.storedBytes > 0 ? `${formatBytes(s.storedBytes)} stored on this device` : '');
  if (s.backend) {
    setText(el(root, 'backend'), s.backend.kind === 'webgpu' ? `WebGPU${s.backend.fp16 ? ' · fp16' : ''}` : `WASM · ${s.backend.threads} thread${s.backend.threads === 1 ? '' : 's'}`);
    setText(el(root, 'adapter'), s.backend.adapter);
    setText(el(root, 'backend-reason'), s.backend.reason);
    const q = s.quantization;
    const quant = s.backend.weights !== 'q4' ? '' : q.quantized > 0 ? ` · quantized ${q.quantized} matrices here (${Math.round(q.quantizeMs)} ms)` : q.loaded > 0 ? ` · ${q.loaded} matrices from storage, none quantized` : '';
    setText(el(root, 'weights'), `${s.backend.weights === 'q4' ? '4-bit' : s.backend.weights} weights · ${s.backend.graphs} graphs${quant}`);
    setText(el(root, 'precision'), s.backend.precision);
  }
  setText(el(root, 'tokens'), formatCount(s.tokensServed));
  setText(el(root, 'requests'), `${formatCount(s.requestsServed)} request${s.requestsServed === 1 ? '' : 's'}`);
  setText(el(root, 'rpm'), formatCount(s.requestsPerMinute));
  const recent = [...(s.recentForwardMs ?? [])].sort((a, b) => a - b);
  const p50 = recent.length > 0 ? ` · ${recent[Math.floor(recent.length / 2)]!.toFixed(1)} ms per request` : '';
  setText(el(root, 'sessions'), `${s.sessions} session${s.sessions === 1 ? '' : 's'} · ${formatBytes(s.kvBytes)} of ${formatBytes(s.kvBudgetBytes)} KV cache${p50}`);

  const spark = el(root, 'spark');
  const line = spark.querySelector('polyline');
  const pts = sparklinePoints(s.throughput, 300, 64);
  if (line && line.getAttribute('points') !== pts) line.setAttribute('points', pts);
  const last = s.throughput[s.throughput.length - 1] ?? 0;
  const peak = Math.max(0, ...s.throughput);
  const title = spark.querySelector('title');
  if (title) setText(title as unknown as HTMLElement, peak > 0 ? `Now ${last.toFixed(1)} tokens/s, peak ${peak.toFixed(1)} in the last minute` : 'No traffic in the last minute');

  const budgetMiB = Math.round(s.memoryBudgetBytes / (1024 * 1024));
  const budget = el<HTMLInputElement>(root, 'budget');
  // Leave the slider alone while the donor drags it.
  if (root.getElementById('budget') !== (globalThis.document?.activeElement ?? null) && budget.value !== String(budgetMiB)) budget.value = String(budgetMiB);
  setText(el(root, 'budget-value'), formatBytes(s.memoryBudgetBytes));

  setText(el(root, 'peer').firstElementChild as HTMLElement, s.peerId ?? '—');
  setText(el(root, 'relay'), s.relayUrl ? `via ${s.relayUrl}` : '');
  setText(el(root, 'isolation'), s.crossOriginIsolated ? 'Cross-origin isolated (threads available)' : 'Not cross-origin isolated: WASM runs on one thread');
}

/** The pause button: Pause, "Pausing… 24 s" while the chats in flight finish, Resume. */
export function pauseLabel(s: NodeStatus): string {
  if (!s.donor.paused) return 'Pause';
  if (s.drain && !s.drain.done) return `Pausing… ${Math.ceil(s.drain.graceLeftMs / 1000)} s`;
  return 'Resume';
}

function pausedText(s: NodeStatus): string {
  const battery = s.drain?.reasons.includes('battery') && !s.donor.paused;
  if (battery) return 'Paused while on battery (you chose to donate only while charging); it serves again on the charger.';
  if (s.drain && !s.drain.done) return `Pausing: the chats in flight finish (at most ${Math.ceil(s.drain.graceLeftMs / 1000)} s more), no new ones come. The layers stay loaded.`;
  return 'Paused: no requests come to this tab. The layers stay loaded: Resume serves again at once.';
}

function powerText(s: NodeStatus): string {
  if (s.onBattery === undefined) return s.donor.chargingOnly ? 'This browser cannot tell whether the device is charging: donating as usual.' : '';
  if (s.onBattery) return s.donor.chargingOnly ? 'On battery: paused until the device is charging.' : 'On battery.';
  return 'Charging.';
}

/** "45 min", "2.5 h", "130 h". */
export function formatDuration(ms: number): string {
  const min = ms / 60_000;
  if (min < 60) return `${Math.floor(min)} min`;
  const h = min / 60;
  return `${h < 10 ? h.toFixed(1) : Math.round(h)} h`;
}

/** What the page itself knows (not the node): storage, the Web Lock, the tab's lifecycle. */
export interface PageView {
  storage?: string;
  lock?: boolean;
  lifecycle?: string;
}

export function renderPage(root: ViewRoot, p: PageView): void {
  if (p.storage !== undefined) setText(el(root, 'storage'), p.storage);
  if (p.lock !== undefined) setText(el(root, 'lock'), p.lock ? 'Holding a Web Lock: the browser will not freeze this tab to save energy.' : 'Not holding a Web Lock (paused or not serving): the browser may freeze this tab.');
  if (p.lifecycle !== undefined) setText(el(root, 'lifecycle'), p.lifecycle);
}

/** Shown when the page was opened without a span (until the tracker assigns one). */
export function renderNeedsConfig(root: ViewRoot, message: string): void {
  const badge = el(root, 'state');
  badge.dataset.state = 'idle';
  setText(badge, LABELS.idle);
  setText(el(root, 'headline'), 'No span to serve');
  setText(el(root, 'reason'), message);
  const action = el(root, 'action');
  setText(action, 'Open this page with ?relay=ws://HOST:PORT/ws&model=<model base URL>&layers=0-6 (optionally &backend=wasm|webgpu, &weights=f32|f16|q4).');
  setHidden(action, false);
}
