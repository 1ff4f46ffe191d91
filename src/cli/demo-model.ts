/**
 * The demo's models: `fortunes-tiny`, a checkpoint with learned weights that
 * ships in the repository (models/fortunes-tiny/, 16 MB), so a fresh clone's
 * `npm start` prints English; or one of the generated fixture presets
 * (random weights, made on first use under .models/), which tests use.
 */
import { join } from 'node:path';
import { openSafetensors } from '../model/safetensors.ts';
import type { DemoModel } from './demo-options.ts';
import { defaultModelDir, ensureModel, hasModel } from './models.ts';
import { REPO_ROOT } from './paths.ts';

/** Checkpoints in the repository's models/ folder, with what the demo says about each. */
export const SHIPPED_MODELS = {
  'fortunes-tiny': {
    dir: join(REPO_ROOT, 'models', 'fortunes-tiny'),
    about: 'a Llama-architecture model with learned weights, trained on Debian\'s fortune cookies (fortune-mod data): it answers with quotes',
  },
} as const;

export type ShippedModel = keyof typeof SHIPPED_MODELS;

export function isShipped(name: DemoModel): name is ShippedModel {
  return Object.hasOwn(SHIPPED_MODELS, name);
}

export interface DemoModelDir {
  dir: string;
  /** One line for the demo's log: where the files are and whether anything was generated. */
  status: string;
  /** Whether its weights are learned (the output reads as language) or random. */
  learned: boolean;
}

/** The model's folder: the shipped one, or the generated preset (made when missing; `onGenerate` says so first). */
export async function demoModelDir(name: DemoModel, onGenerate: () => void): Promise<DemoModelDir> {
  if (isShipped(name)) return { dir: SHIPPED_MODELS[name].dir, status: `shipped in ${SHIPPED_MODELS[name].dir}`, learned: true };
  const cached = await hasModel(defaultModelDir(name), name);
  if (!cached) onGenerate();
  const dir = await ensureModel(name);
  return { dir, status: `${cached ? 'cached' : 'generated'} at ${dir}`, learned: false };
}

/** Parameters in the checkpoint (its tensors' elements; a tied head counts once), from the safetensors headers. */
export async function countParameters(modelUrl: string): Promise<number> {
  const reader = await openSafetensors(fetch, modelUrl);
  let n = 0;
  for (const t of reader.tensorInfos.values()) n += t.shape.reduce((a, b) => a * b, 1);
  return n;
}

/** "7.8M", "31.5M", "1.2B". */
export function formatParams(n: number): string {
  return n >= 1e9 ? `${(n / 1e9).toFixed(1)}B` : n >= 1e6 ? `${(n / 1e6).toFixed(1)}M` : `${(n / 1e3).toFixed(0)}k`;
}

/** What the demo says the model is: name, size, layers, and where its weights come from. */
export function describeDemoModel(name: DemoModel, params: number, layers: number, hidden: number): string {
  const shape = `${formatParams(params)} parameters, ${layers} layers, hidden ${hidden}`;
  if (isShipped(name)) return `"${name}": ${shape}; ${SHIPPED_MODELS[name].about}`;
  return `"${name}": ${shape}; a generated fixture with random weights: the words are noise, the mesh that computed them is real`;
}
