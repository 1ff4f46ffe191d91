/**
 * `meshnet demo --nodes N`: each page's budget must let N pages hold every
 * layer between them, as the tracker really places them. Checked by joining
 * N signed nodes of that budget to a tracker app (the real assignment code),
 * on the shipped `fortunes-tiny` checkpoint the demo serves by default and on
 * the generated `small`, sized as the demo sizes them.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { pageBudget } from '../../src/cli/demo.ts';
import { SHIPPED_MODELS } from '../../src/cli/demo-model.ts';
import { CliError } from '../../src/cli/failure.ts';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { loadModelSpec, type ModelSpec } from '../../src/tracker/model-registry.ts';
import { resolveTrackerOptions } from '../../src/tracker/options.ts';
import { FakeNode, makeTracker } from '../helpers/tracker.ts';

/** Layers nobody holds after `nodes` nodes of `budgetMb` join the tracker one after another. */
async function bareAfterJoining(spec: ModelSpec, nodes: number, budgetMb: number): Promise<number[]> {
  const t = await makeTracker({}, undefined, [spec]);
  for (let i = 0; i < nodes; i++) await (await FakeNode.create({ model: spec.name, memory_budget_mb: budgetMb })).join(t);
  const av = (await (await t.app.request(`/api/availability?model=${spec.name}`)).json()) as { models: Array<{ missing_layers: number[] }> };
  return av.models[0]!.missing_layers;
}

describe('the demo\'s budget per page', () => {
  let files: StaticServer[] = [];
  const models: ModelSpec[] = [];
  let small: ModelSpec;
  beforeAll(async () => {
    // The shipped default (6 layers, 7.8M parameters) and the generated `small` (12 layers, ~38M).
    for (const [name, dir] of [['fortunes-tiny', SHIPPED_MODELS['fortunes-tiny'].dir], ['small', await ensureModel('small')]] as const) {
      const st = await startStaticServer({ root: dir });
      files.push(st);
      models.push(await loadModelSpec(name, `${st.url}/`, fetch, resolveTrackerOptions({})));
    }
    small = models[1]!;
  });
  afterAll(async () => {
    await Promise.all(files.map((f) => f.close()));
    files = [];
  });

  it('is the least whole MiB with which 1, 2, 3 or 4 pages hold every layer, for the shipped model and for small', async () => {
    for (const model of models) {
      for (const nodes of [1, 2, 3, 4]) {
        const budget = pageBudget(model, nodes, undefined);
        expect(await bareAfterJoining(model, nodes, budget), `${nodes} pages of ${budget} MiB on ${model.name}`).toEqual([]);
        expect((await bareAfterJoining(model, nodes, budget - 1)).length, `${nodes} pages of ${budget - 1} MiB on ${model.name}`).toBeGreaterThan(0);
      }
    }
    // The fault a fixed 60 MiB had: two pages of it left the end of small bare.
    expect(await bareAfterJoining(small, 2, 60)).toEqual([8, 9, 10, 11]);
  });

  it('keeps a budget the user gave when it is enough, and refuses one that is not, naming the budget that is', () => {
    expect(pageBudget(small, 2, 200)).toBe(200);
    const needed = pageBudget(small, 2, undefined);
    expect(() => pageBudget(small, 2, 60)).toThrow(CliError);
    expect(() => pageBudget(small, 2, 60)).toThrow(new RegExp(`layers 8–11 of "small" without a node: give --budget ${needed} or more`));
  });
});
