/**
 * `meshnet demo --nodes N`: each page's budget must let N pages hold every
 * layer between them, as the tracker really places them. Checked by joining
 * N signed nodes of that budget to a tracker app (the real assignment code),
 * on the `small` checkpoint the demo serves, sized as the demo sizes it.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { pageBudget } from '../../src/cli/demo.ts';
import { DEMO_DEFAULTS } from '../../src/cli/demo-options.ts';
import { CliError } from '../../src/cli/failure.ts';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { loadModelSpec, type ModelSpec } from '../../src/tracker/model-registry.ts';
import { resolveTrackerOptions } from '../../src/tracker/options.ts';
import { FakeNode, makeTracker } from '../tracker/support.ts';

/** Layers nobody holds after `nodes` nodes of `budgetMb` join the tracker one after another. */
async function bareAfterJoining(spec: ModelSpec, nodes: number, budgetMb: number): Promise<number[]> {
  const t = await makeTracker({}, undefined, [spec]);
  for (let i = 0; i < nodes; i++) await (await FakeNode.create({ model: spec.name, memory_budget_mb: budgetMb })).join(t);
  const av = (await (await t.app.request(`/api/availability?model=${spec.name}`)).json()) as { models: Array<{ missing_layers: number[] }> };
  return av.models[0]!.missing_layers;
}

describe('the demo\'s budget per page', () => {
  let files: StaticServer;
  let small: ModelSpec;
  beforeAll(async () => {
    files = await startStaticServer({ root: await ensureModel('small') });
    small = await loadModelSpec('small', `${files.url}/`, fetch, resolveTrackerOptions({}));
  });
  afterAll(() => files.close());

  it('lets 1, 2, 3 or 4 pages hold every layer of small, and is the least whole MiB that does for 1 and 2', async () => {
    // The fault: the old fixed 60 MiB left layers bare with fewer than three pages.
    expect(await bareAfterJoining(small, 2, DEMO_DEFAULTS.budgetMb)).toEqual([8, 9, 10, 11]);
    for (const nodes of [1, 2, 3, 4]) {
      const budget = pageBudget(small, nodes, undefined);
      expect(budget).toBeGreaterThanOrEqual(DEMO_DEFAULTS.budgetMb);
      expect(await bareAfterJoining(small, nodes, budget), `${nodes} pages of ${budget} MiB`).toEqual([]);
      if (nodes <= 2) expect((await bareAfterJoining(small, nodes, budget - 1)).length).toBeGreaterThan(0);
    }
    // Three pages keep the default: each holds a third of the model, so a chat crosses all three.
    expect(pageBudget(small, 3, undefined)).toBe(DEMO_DEFAULTS.budgetMb);
  });

  it('keeps a budget the user gave when it is enough, and refuses one that is not, naming the budget that is', () => {
    expect(pageBudget(small, 2, 200)).toBe(200);
    const needed = pageBudget(small, 2, undefined);
    expect(() => pageBudget(small, 2, 60)).toThrow(CliError);
    expect(() => pageBudget(small, 2, 60)).toThrow(new RegExp(`layers 8–11 of "small" without a node: give --budget ${needed} or more`));
  });
});
