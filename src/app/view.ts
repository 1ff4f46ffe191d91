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
      : s.state === 'paused' ? 'Paused: new requests are refused; the layers stay stored.'
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
  const paused = s.state === 'paused';
  if (pause.getAttribute('aria-pressed') !== String(paused)) pause.setAttribute('aria-pressed', String(paused));
  setText(pause, paused ? 'Resume' : 'Pause');

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
